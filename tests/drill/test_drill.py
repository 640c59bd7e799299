"""`trainwatch drill`: the catalog, the settings files it writes, scoring on synthetic run
directories (written with the run-directory writers at chosen times, so every number has
an exact expected value), the process handling, and real drills end to end."""

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from agent_helpers import start_agent, stop_process, wait_for
from conftest import kill_tree
from trainwatch.drill import catalog
from trainwatch.drill.agent_findings import FindingsWatcher
from trainwatch.drill.runner import RECORD_FORMAT, record_file, stop_tree
from trainwatch.drill.score import CRITERIA, launcher_failures, score
from trainwatch.drill.settings import changed_defaults, settings_for, write_files
from trainwatch.errors import ConfigError
from trainwatch.node import node_name
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.atomic import append_jsonl, atomic_write_json

T0 = 1_800_000_000.0


def drill_cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "trainwatch", "drill", *args],
                          capture_output=True, text=True, timeout=timeout)


# --------------------------------------------------------------------------- the catalog

def test_every_drill_injects_a_valid_fault_that_real_rules_and_findings_can_detect():
    from trainwatch.alerts.rules import load_rules
    from trainwatch.trainer.faults import parse_faults

    rules = {r.name: r for r in load_rules().rules}
    names = catalog.names()
    assert len(set(names)) == len(names) >= 6
    assert {"rank-killed", "rank-crash", "hung-rank", "frozen-rank", "nan-batch",
            "straggler"} <= set(names)
    assert {"supervisor-killed", "two-supervisors"} <= set(names)
    for drill in catalog.DRILLS:
        faults = parse_faults(drill.fault_env())
        if drill.supervisor_fault or drill.node_fault:  # the drill acts; ranks only paced
            assert [f.kind for f in faults] == ["slow"] and drill.pace
        else:
            assert faults[0].kind == drill.fault_kind and faults[0].rank == drill.fault_rank
        assert drill.fault.startswith(f"{drill.fault_kind}:")
        assert drill.detect, drill.name
        for signal in drill.detect:
            if signal.kind == catalog.ALERT:
                assert signal.name in rules, signal
            elif signal.kind == catalog.SUPERVISOR:
                assert drill.supervisor_fault and signal.name in catalog.SUPERVISOR_SIGNALS
            elif signal.kind == catalog.EVENT:
                assert (drill.node_fault, signal.name) == (catalog.NODE_LOST, "node_lost")
            else:
                assert (signal.kind, signal.name) in {(catalog.FINDING, "stall"),
                                                      (catalog.FINDING, "straggler"),
                                                      (catalog.LAUNCHER, "torchrun")}
        alert_actions = {rules[s.name].action for s in drill.detect if s.kind == catalog.ALERT}
        if drill.recovery == catalog.CONTROLLER and drill.action != "restart":
            assert drill.action in alert_actions, drill.name  # an alert asks for the action
        assert (drill.recover_within is None) == (drill.recovery == catalog.NONE)
    with pytest.raises(ConfigError, match="unknown drill 'nope'.*rank-killed"):
        catalog.get("nope")


def test_the_settings_files_a_drill_writes_load_with_the_real_loaders(tmp_path):
    from trainwatch.agent.config import load_config as load_agent_config
    from trainwatch.alerts.rules import load_rules
    from trainwatch.trainer.config import load_config as load_trainer_config

    for drill in catalog.DRILLS:
        settings = settings_for(drill, steps=drill.steps + 3)
        files = write_files(settings, tmp_path / drill.name)
        ruleset = load_rules(None, files["thresholds"])
        assert ruleset.thresholds["evaluation_interval"] == "1s"
        for key, value in drill.thresholds.items():
            assert ruleset.thresholds[key] == value
        agent = load_agent_config(files["agent"], run_dirs=[str(tmp_path)])
        assert agent.collector("ranks")["interval"] == 0.5
        trainer = load_trainer_config(files["train"])
        assert trainer.train.steps == drill.steps + 3
        assert trainer.checkpoint.every_steps == settings.checkpoint_every == 10
    # What the output admits: every shortened wait, with its production default.
    rows = {r["key"]: r for r in changed_defaults(catalog.get("hung-rank"))}
    assert rows["stall_for"]["drill"] == "2s" and rows["stall_for"]["default"] == "1m"
    assert rows["evaluation_interval"]["default"] == "5s"
    assert "rank_down_for" not in rows and "rank_down_for" in {
        r["key"] for r in changed_defaults(catalog.get("rank-killed"))}


def test_impossible_settings_are_bad_usage():
    drill = catalog.get("rank-killed")
    with pytest.raises(ConfigError, match="at least 2"):
        settings_for(drill, nproc_per_node=1)
    with pytest.raises(ConfigError, match="fault at step 15: needs at least 20 steps"):
        settings_for(drill, steps=19)
    assert settings_for(drill, steps=20, detect_within=0).detect_within == 0


def test_the_multi_node_drills_run_the_documented_slurm_node_command(tmp_path):
    """nodes-rank-killed, nodes-frozen-rank, node-lost: 2 nodes x 2 ranks, the drill acts
    on node 2; node-lost goes on with fewer nodes (--min-nnodes 1) and may lose 1 step."""
    from trainwatch.drill import nodes, score_nodes
    from trainwatch.drill.netns import Node

    multi = {d.name: d for d in catalog.DRILLS if d.nnodes > 1}
    assert sorted(multi) == ["node-lost", "nodes-frozen-rank", "nodes-rank-killed"]
    assert {d.node_fault for d in multi.values()} == {catalog.KILL_RANK, catalog.FREEZE_RANK,
                                                      catalog.NODE_LOST}
    lost = multi["node-lost"]
    assert lost.fault == "node_lost:node=2:step=15" and lost.min_nnodes == 1
    assert settings_for(lost).steps_lost_max == 1 and lost.recovery == catalog.TORCHRUN
    assert multi["nodes-frozen-rank"].recovery == catalog.REPAIR
    pair = [Node(i, f"tw-n{i}-x", f"twv{i}-x", f"10.77.0.{i + 1}") for i in range(2)]
    files = {name: tmp_path / f"{name}.yaml" for name in ("train", "thresholds", "agent")}
    cmd = nodes.node_command(settings_for(lost), pair, pair[1], "/runs/slurm-7", files)
    assert cmd[:4] == ["ip", "netns", "exec", "tw-n1-x"]
    assert cmd[5:9] == ["-m", "trainwatch", "run", "/runs/slurm-7"]
    flags = {cmd[i]: cmd[i + 1] for i in range(9, len(cmd) - 1) if cmd[i].startswith("--")}
    assert {k: flags[k] for k in ("--nnodes", "--node-rank", "--rdzv-endpoint", "--local-addr",
                                  "--min-nnodes")} == {
        "--nnodes": "2", "--node-rank": "1", "--rdzv-endpoint": "10.77.0.1:29400",
        "--local-addr": "10.77.0.2", "--min-nnodes": "1"}
    # The shipped agent config, with the drill's waits and without its discover folder.
    agent = nodes.agent_config(settings_for(lost), nodes.default_deploy_dir(), tmp_path)
    from trainwatch.agent.config import load_config
    loaded = load_config(str(agent), run_dirs=[str(tmp_path)])
    assert loaded.stall["floor_seconds"] == 3 and "discover" not in agent.read_text()
    # One restart on every node that is left; the lost one restarts nothing.
    ran = [{"node": "a", "restarts": 1, "ranks": [0, 1]}, {"node": "b", "restarts": 0,
                                                           "ranks": []}]
    (ok,) = score_nodes.criteria(lost, ran, {"node": "b"})
    assert ok["passed"] and ok["detail"] == "a: 1 restart (ranks 0, 1); b: lost, no restart"
    (bad,) = score_nodes.criteria(multi["nodes-rank-killed"], ran, {"node": "b"})
    assert not bad["passed"] and bad["detail"] == "b: 0 restarts (ranks none), expected 1"


def test_a_multi_node_drill_without_root_exits_2_with_the_reason(tmp_path, monkeypatch):
    from click.testing import CliRunner
    from trainwatch.drill import netns
    from trainwatch.drill.cli import drill

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    out = tmp_path / "out"
    done = CliRunner().invoke(drill, ["run", "rank-killed", "node-lost", "--out", str(out)])
    assert isinstance(done.exception, ConfigError) and done.exception.exit_code == 2
    assert str(done.exception.problem) == (
        "drill node-lost runs its 2 nodes as network namespaces and cannot here: needs root "
        "to create network namespaces (run it as root on a Linux machine)")
    assert not out.exists()  # refused before the first drill started


@pytest.mark.parametrize("change, file, key", [
    ({"agent": {"stall": {"floor_secs": 1}}}, "drill rank-killed (agent)", "stall.floor_secs"),
    ({"agent": {"collectors": {"ranks": {"interval": 0}}}}, "drill rank-killed (agent)",
     "collectors.ranks.interval"),
    ({"thresholds": {"stall_for": "soon"}}, "drill rank-killed (thresholds)", "stall_for"),
])
def test_a_drill_with_a_bad_setting_fails_before_it_runs_naming_the_key(change, file, key):
    import dataclasses

    drill = dataclasses.replace(catalog.get("rank-killed"), **change)
    with pytest.raises(ConfigError) as err:
        settings_for(drill)
    assert (err.value.file, err.value.key) == (file, key)


def test_list_shows_the_catalog_and_its_json_is_stable():
    done = drill_cli("list", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["format"] == "trainwatch.drill.catalog" and data["version"] == 1
    assert [d["name"] for d in data["drills"]] == catalog.names()
    nan = next(d for d in data["drills"] if d["name"] == "nan-batch")
    assert nan["action"] == "rollback_skip" and nan["fault"] == "nan:rank=1:step=15"
    assert nan["detection"][0] == {"kind": "alert", "name": "TrainingLossNonFinite",
                                   "text": "alert TrainingLossNonFinite"}
    assert set(nan["criteria"]) == {"detect_within_seconds", "recover_within_seconds",
                                    "steps_lost_max", "run_finishes", "no_duplicate_actions"}
    # The bound each drill is scored against, not one phrase for all (issue #36).
    lost = {d["name"]: d["criteria"]["steps_lost_max"] for d in data["drills"]}
    assert lost == {d.name: settings_for(d).steps_lost_max for d in catalog.DRILLS}, lost
    assert lost["rank-killed"] == 1 and lost["node-lost"] == 1 and lost["nan-batch"] == 10
    text = drill_cli("list")
    assert text.returncode == 0
    for name in catalog.names():
        assert name in text.stdout
    assert "stall_for 2s (default 1m)" in text.stdout


@pytest.mark.parametrize("args, message", [
    (["nope"], "unknown drill 'nope'"),
    ([], "name at least one drill"),
    (["rank-killed", "--all"], "not both"),
    (["rank-killed", "--nproc-per-node", "1"], "at least 2"),
    (["rank-killed", "--steps", "3"], "needs at least 20 steps"),
    (["rank-killed", "--timeout", "0"], "--timeout"),
    (["rank-killed", "--detect-within", "-1"], "--detect-within"),
])
def test_bad_usage_exits_2_before_anything_runs(tmp_path, args, message):
    done = drill_cli("run", *args, "--out", str(tmp_path / "out"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# --------------------------------------------------------------------------- scoring

class DrillRun:
    """A drill's run directory as trainwatch run, the trainer and the drill runner write it,
    at chosen times (seconds after T0)."""

    def __init__(self, root: Path, name: str, *, findings=(), exit_code=0, timed_out=False,
                 **overrides):
        self.run = RunDir(root).create()
        self.drill = catalog.get(name)
        settings = settings_for(self.drill, **overrides)
        self.run.write_run_info({"job": root.name, "world_size": 2, "nproc_per_node": 2,
                                 "config": settings.trainer})
        self.record = {"format": RECORD_FORMAT, "version": 1, "drill": name,
                       "fault": self.drill.fault, "settings": settings.to_json(),
                       "started_at": T0, "ended_at": T0 + 80, "exit_code": exit_code,
                       "timed_out": timed_out, "interrupted": False,
                       "findings": [{"id": f"{kind}/job/1", "kind": kind, "rank": 1,
                                     "detected_at": T0 + at} for kind, at in findings]}
        (self.run.root / "drill").mkdir()
        atomic_write_json(record_file(self.run), self.record)
        self.pid = 100

    def event(self, at, name, source="engine", **fields):
        append_jsonl(self.run.journal_file, {"v": 1, "time": T0 + at, "event": name,
                                             "source": source, "host": "h", **fields})

    def attempt(self, at, restart_count=0, resumed=None, **resume_fields):
        for rank in (0, 1):
            self.pid += 1
            self.event(at, "rank_started", f"rank{rank}", rank=rank, pid=self.pid,
                       restart_count=restart_count)
        if resumed is not None:
            self.event(at + 0.5, "checkpoint_resumed", "rank0", step=resumed, **resume_fields)

    def steps(self, first, last, start, seconds=1.0):
        for i, step in enumerate(range(first, last + 1)):
            append_jsonl(self.run.metrics_file(0), {
                "v": 1, "kind": "step", "step": step, "time": T0 + start + (i + 1) * seconds,
                "rank": 0, "step_time_seconds": seconds, "data_wait_seconds": 0.0,
                "tokens": 256, "loss": 2.0})

    def torchrun_failed(self, at, local_rank=1, code=-9):
        stamp = time.strftime("%m%d %H:%M:%S", time.localtime(T0 + at))
        with open(self.run.logs_dir / "torchrun.log", "a") as fh:
            fh.write(f"E{stamp}.250000 5188 site-packages/torch/distributed/elastic/"
                     f"multiprocessing/api.py:1002] failed (exitcode: {code}) local_rank: "
                     f"{local_rank} (pid: 4242) of binary: /usr/bin/python\n")


def hung_rank(root, *, duplicate=False, resumed=15, **kw):
    """hung-rank: rank 1 hangs in step 15 at +17 s; the agent flags the stall at +21 s,
    TrainingStallSuspected fires at +23 s, stall_restart at +28 s; the job resumes from the
    memory snapshot of step 15 (``resumed=10``: from checkpoint 10) and its first step ends at
    +37 s; it finishes at +61 s (+66 s)."""
    r = DrillRun(root, "hung-rank", findings=[("stall", 21.0)], **kw)
    r.event(0, "controller_started", agent=["127.0.0.1:1"])
    r.event(0.1, "job_started", pid=1, attempt=1)
    r.attempt(1)
    r.steps(0, 14, start=1)
    r.event(11.5, "checkpoint_saved", "rank0", step=10, reason="interval")
    r.event(17, "fault_injected", "rank1", rank=1, step=15, fault="hang")
    for rank, at in ((1, 23), (0, 23.1)):
        r.event(at, "alert_firing", alert="TrainingStallSuspected", severity="info",
                labels={"rank": str(rank), "run": "j"})
    r.event(28, "job_stopped", pid=1, hard=True, returncode=-9)
    r.event(28, "job_started", pid=2, attempt=2)
    r.event(28, "action_taken", action="stall_restart", alert="TrainingStallSuspected")
    r.event(28.1, "action_skipped", action="stall_restart", alert="TrainingStallSuspected",
            reason="rate limited")
    r.attempt(35, resumed=resumed, state_from="memory snapshot" if resumed == 15
              else "checkpoint")
    if duplicate:  # a second delivery acted again: a second restart for the same fault
        r.steps(resumed, 29, start=36)
        r.event(57, "action_taken", action="stall_restart", alert="TrainingStallSuspected")
        r.attempt(58, resumed=20)
        r.steps(20, 39, start=59)
        end = 80
    else:
        r.steps(resumed, 39, start=36)
        end = 36 + 40 - resumed
    r.event(end, "finished", "rank0", step=39)
    r.event(end + 1, "job_exited", pid=2, returncode=0)
    r.event(end + 2, "controller_stopped", exit_code=0)
    return r


def verdicts(card):
    return {c["name"]: c for c in card["criteria"]}


def test_a_drill_that_worked_passes_every_criterion_with_its_numbers(tmp_path):
    r = hung_rank(tmp_path / "hung")
    card = score(r.run)
    assert [c["name"] for c in card["criteria"]] == list(CRITERIA)
    assert card["passed"], card["criteria"]
    assert card["fault_injected"] == {"at": T0 + 17, "step": 15, "rank": 1,
                                      "seconds_into_run": 17.0}
    det = card["detection"]
    assert det["first"] == "agent finding stall" and det["seconds"] == pytest.approx(4.0)
    alert = next(s for s in det["signals"] if s["kind"] == "alert")
    assert alert["seconds"] == pytest.approx(6.0)
    rec = card["recovery"]
    assert rec["by"] == "controller" and rec["restarts"] == 1 and rec["resumed_from"] == 15
    assert rec["seconds"] == pytest.approx(37 - 17)
    assert card["steps"]["lost"] == 0 and card["steps"]["checkpoint_interval"] == 10
    assert card["steps"]["resumed_with"] == "memory snapshot" and card["steps"]["lost_max"] == 1
    assert verdicts(card)["steps lost"]["detail"] == (
        "0 (fault at step 15, resumed from memory snapshot, step 15) <= 1 with memory "
        "snapshots (checkpoint interval 10)")
    assert card["steps"]["recomputed"] == 0  # the hung step 15 never completed
    assert [a["action"] for a in card["actions"] if a["taken"]] == ["stall_restart"]
    assert "stall_restart once; 1 restart" in verdicts(card)["no duplicate actions"]["detail"]
    assert len(card["report"]["incidents"]) == 1


def test_a_rank_failure_that_resumed_from_the_checkpoint_lost_too_many_steps(tmp_path):
    """hung-rank resumed from checkpoint 10, not from the memory snapshot of step 15: 5 steps
    lost, within the checkpoint interval but over the 1 step a memory snapshot allows."""
    card = score(hung_rank(tmp_path / "hung", resumed=10).run)
    lost = verdicts(card)["steps lost"]
    assert not lost["passed"] and not card["passed"]
    assert lost["detail"] == ("5 (fault at step 15, resumed from checkpoint, step 10): more "
                              "than 1 with memory snapshots (checkpoint interval 10) (an older "
                              "state was used)")
    assert card["steps"]["recomputed"] == 5


def test_a_detection_later_than_the_deadline_fails_and_says_by_how_much(tmp_path):
    r = hung_rank(tmp_path / "hung", detect_within=3)
    card = score(r.run)
    assert not card["passed"]
    detected = verdicts(card)["detected"]
    assert not detected["passed"]
    assert "too late: agent finding stall after 4.0 s, more than the 3 s allowed" \
        in detected["detail"]
    assert all(c["passed"] for c in card["criteria"] if c["name"] != "detected")
    # The command line overrides the deadline the drill ran with, both ways.
    assert score(r.run, detect_within=5)["passed"]
    done = drill_cli("score", str(r.run.root), "--json", "--detect-within", "1.5")
    assert done.returncode == 1, done.stderr
    data = json.loads(done.stdout)
    assert data["format"] == "trainwatch.drill" and data["passed"] is False
    assert "more than the 1.5 s allowed" in verdicts(data["drills"][0])["detected"]["detail"]
    text = drill_cli("score", str(r.run.root), "--detect-within", "10")
    assert text.returncode == 0 and "PASS" in text.stdout and "FAIL" not in text.stdout


def test_a_duplicated_action_fails_the_drill(tmp_path):
    card = score(hung_rank(tmp_path / "hung", duplicate=True).run)
    dup = verdicts(card)["no duplicate actions"]
    assert not dup["passed"] and not card["passed"]
    assert dup["detail"] == ("stall_restart taken 2 times; the job was restarted 2 times for "
                             "one fault")


def supervisor_killed(root, *, second_job=False):
    """supervisor-killed: the drill SIGKILLs trainwatch run at step 16 (+17 s); its tree is
    gone at +20 s; the same command again starts at +22 s, resumes from checkpoint 10, its
    first step ends at +31 s and it finishes. ``second_job``: one more supervisor started
    a job beside it."""
    r = DrillRun(root, "supervisor-killed")
    r.event(0, "controller_started", agent=["127.0.0.1:1"])
    r.event(0.1, "job_started", pid=1, attempt=1)
    r.attempt(1)
    r.steps(0, 16, start=1)
    r.event(11.5, "checkpoint_saved", "rank0", step=10, reason="interval")
    r.event(17, "fault_injected", "drill", step=16, fault="supervisor_kill", pid=42)
    r.event(20, "supervisor_tree_gone", "drill", processes=5, seconds=3.0)
    r.event(22, "controller_started", agent=["127.0.0.1:2"])
    if second_job:
        r.event(22.5, "controller_started", agent=["127.0.0.1:3"])
    r.event(22.1, "job_started", pid=2, attempt=1)
    r.attempt(29, resumed=10)
    r.steps(10, 39, start=30)
    r.event(61, "finished", "rank0", step=39)
    r.event(62, "controller_stopped", exit_code=0)
    return r


def two_supervisors(root, *, second_exit=2):
    """two-supervisors: at step 15 (+17 s) the drill starts the same command again; it exits
    ``second_exit`` at +21 s; the first run finishes untouched."""
    r = DrillRun(root, "two-supervisors")
    r.event(0, "controller_started", agent=["127.0.0.1:1"])
    r.event(0.1, "job_started", pid=1, attempt=1)
    r.attempt(1)
    r.steps(0, 59, start=1)
    r.event(17, "fault_injected", "drill", step=15, fault="second_supervisor", holder=42)
    if second_exit != 2:  # it did not refuse: it started a job of its own
        r.event(19, "controller_started", agent=["127.0.0.1:2"])
    r.event(21, "second_supervisor_exited", "drill", exit_code=second_exit,
            named_holder=second_exit == 2, seconds=4.0)
    r.event(62, "finished", "rank0", step=59)
    r.event(63, "controller_stopped", exit_code=0)
    return r


def test_the_supervisor_drills_score_the_guards_and_fail_two_jobs(tmp_path):
    card = score(supervisor_killed(tmp_path / "killed").run)
    assert card["passed"], card["criteria"]
    v = verdicts(card)
    assert v["fault injected"]["detail"].startswith("supervisor_kill on trainwatch run (pid 42)")
    assert card["detection"]["first"] == catalog.SUPERVISOR_SIGNALS["tree-gone"]
    assert card["detection"]["seconds"] == pytest.approx(3.0)
    assert card["recovery"]["by"] == "rerun" and card["recovery"]["resumed_from"] == 10
    assert "running the same command again" in v["recovered"]["detail"]
    assert card["steps"]["lost"] == 6
    card = score(supervisor_killed(tmp_path / "two-jobs", second_job=True).run)
    v = verdicts(card)
    assert not card["passed"] and not v["no duplicate actions"]["passed"]
    assert "2 supervisors started a job after the fault (expected 1)" \
        in v["no duplicate actions"]["detail"]

    card = score(two_supervisors(tmp_path / "refused").run)
    assert card["passed"], card["criteria"]
    assert card["detection"]["first"] == catalog.SUPERVISOR_SIGNALS["refused"]
    assert card["detection"]["seconds"] == pytest.approx(4.0)
    assert card["recovery"]["restarts"] == 0 and card["steps"]["lost"] == 0
    card = score(two_supervisors(tmp_path / "not-refused", second_exit=0).run)
    v = verdicts(card)
    assert not v["detected"]["passed"] and not v["no duplicate actions"]["passed"]


def sdc_run(root, *, suspects="1", resumed=20, last_bits=("ab", "ab", "ab")):
    """sdc: rank 1's weight flips after step 22 (+23 s); TrainingReplicaDivergence fires at
    +27.1 s (rank 0 had finished step 25) naming ``suspects``; replica_rollback at +27.5 s
    chose checkpoint 20; the job resumes from ``resumed`` and finishes; the ranks' last
    digests are ``last_bits``."""
    r = DrillRun(root, "sdc")
    r.event(0, "controller_started", agent=["127.0.0.1:1"])
    r.event(0.1, "job_started", pid=1, attempt=1)
    r.attempt(1)
    r.steps(0, 30, start=1)
    r.event(21.5, "checkpoint_saved", "rank0", step=20, reason="interval")
    r.event(23, "fault_injected", "rank1", rank=1, step=22, fault="sdc")
    r.event(27.1, "alert_firing", alert="TrainingReplicaDivergence", severity="critical",
            labels={"suspects": suspects, "run": "j", "group": "0"})
    r.event(27.5, "action_taken", action="replica_rollback", alert="TrainingReplicaDivergence",
            clean_checkpoint_step=20, suspects=[{"rank": int(suspects), "node": "h"}],
            divergence={"first_odd_step": 24, "last_agreeing_step": 19})
    r.event(27.5, "job_started", pid=2, attempt=2)
    r.attempt(35, resumed=resumed)
    r.steps(resumed, 59, start=36)
    r.event(80, "finished", "rank0", step=59)
    r.event(81, "job_exited", pid=2, returncode=0)
    r.event(82, "controller_stopped", exit_code=0)
    for rank, bits in enumerate(last_bits):
        atomic_write_json(r.run.status_file(rank), {
            "format": "trainwatch.status", "version": 1, "job": "j", "rank": rank,
            "world_size": 3, "node": "h", "state": "finished", "step": 59,
            "replicas": [{"step": 54, "group": 0, "bits": "aa"},
                         {"step": 59, "group": 0, "bits": bits}]})
    return r


def test_the_sdc_drill_scores_the_suspect_the_steps_the_checkpoint_and_the_digests(tmp_path):
    card = score(sdc_run(tmp_path / "good").run)
    names = [c["name"] for c in card["criteria"]]
    assert names == [*CRITERIA, "suspect named", "detected within steps", "clean checkpoint",
                     "replicas agree at the end"]
    assert card["passed"], card["criteria"]
    v = verdicts(card)
    assert "fired at step 25, 3 steps after the fault (within 20)" \
        in v["detected within steps"]["detail"]
    assert "suspects='1'" in v["suspect named"]["detail"]
    assert "step 59) is bitwise equal on all 3 ranks" in v["replicas agree at the end"]["detail"]
    # Resuming from a checkpoint saved after the flip loses no steps, so only the sdc
    # criterion sees that the corrupted weight came back.
    card = score(sdc_run(tmp_path / "late", resumed=30).run)
    v = verdicts(card)
    assert v["steps lost"]["passed"] and not card["passed"]
    assert not v["clean checkpoint"]["passed"]
    assert "saved after the fault" in v["clean checkpoint"]["detail"]
    card = score(sdc_run(tmp_path / "wrong", suspects="0").run)
    assert not verdicts(card)["suspect named"]["passed"] and not card["passed"]
    card = score(sdc_run(tmp_path / "odd", last_bits=("ab", "ac", "ab")).run)
    v = verdicts(card)
    assert not v["replicas agree at the end"]["passed"]
    assert "rank 1: step 59 bits ac" in v["replicas agree at the end"]["detail"]


def test_the_sdc_drill_needs_three_ranks_for_a_majority():
    assert settings_for(catalog.get("sdc")).nproc_per_node == 3
    assert settings_for(catalog.get("rank-killed")).nproc_per_node == 2
    with pytest.raises(ConfigError, match="drill sdc needs at least 3 ranks, got 2"):
        settings_for(catalog.get("sdc"), nproc_per_node=2)


def test_a_drill_that_is_never_detected_or_never_finishes_fails_with_reasons(tmp_path):
    r = DrillRun(tmp_path / "straggler", "straggler", exit_code=None, timed_out=True)
    r.attempt(1)
    r.steps(0, 30, start=1)
    r.event(12, "fault_injected", "rank1", rank=1, step=10, fault="slow")
    r.event(40, "job_stopped", pid=1, hard=False, returncode=-15)
    card = score(r.run)
    v = verdicts(card)
    assert v["fault injected"]["passed"]
    assert v["detected"]["detail"] == ("not detected: no agent finding straggler and no alert "
                                       "TrainingStragglerRank after the fault")
    assert v["recovered"]["detail"] == "no straggler action was taken (none taken)"
    assert v["run finished"]["detail"].startswith("timed out")
    assert v["steps lost"]["passed"]  # no restart: nothing lost
    assert not card["passed"]


def test_a_fault_that_never_fired_is_said_so(tmp_path):
    r = DrillRun(tmp_path / "killed", "rank-killed")
    r.attempt(1)
    r.steps(0, 12, start=1)
    r.event(20, "finished", "rank0", step=12)
    r.event(21, "job_exited", pid=1, returncode=0)
    card = score(r.run)
    v = verdicts(card)
    assert not v["fault injected"]["passed"]
    assert "reached step 12, the fault was due at step 15" in v["fault injected"]["detail"]
    assert v["detected"]["detail"] == "not scored: no fault was injected"
    assert v["run finished"]["passed"] and not card["passed"]


def test_torchrun_detection_and_restart_are_read_from_its_log(tmp_path):
    """rank-killed: torchrun logs the SIGKILLed worker 0.25 s after the fault and restarts
    both ranks (restart count 1); the controller only watches."""
    r = DrillRun(tmp_path / "killed", "rank-killed")
    r.attempt(1)
    r.steps(0, 14, start=1)
    r.event(11.5, "checkpoint_saved", "rank0", step=10, reason="interval")
    r.event(17, "fault_injected", "rank1", rank=1, step=15, fault="kill")
    r.torchrun_failed(17)
    r.event(18.5, "alert_firing", alert="TrainingRankDown", labels={"rank": "1"})
    r.event(18.6, "action_skipped", action="restart", alert="TrainingRankDown",
            reason="the launcher is still running")
    r.attempt(22, restart_count=1, resumed=14, state_from="memory snapshot")
    r.steps(14, 39, start=23)
    r.event(54, "finished", "rank0", step=39)
    r.event(55, "job_exited", pid=1, returncode=0)
    assert launcher_failures(r.run, T0 + 17) == [pytest.approx(T0 + 17.25)]
    card = score(r.run)
    assert card["passed"], card["criteria"]
    assert card["detection"]["first"] == "torchrun: worker failed"
    assert card["detection"]["seconds"] == pytest.approx(0.25)
    assert card["recovery"]["by"] == "torchrun" and card["recovery"]["seconds"] == 7
    # The same story with a controller restart on top is not what this drill expects.
    r.event(30, "action_taken", action="restart", alert="TrainingRankDown")
    assert "expected torchrun to restart the ranks: the controller acted (restart)" in \
        verdicts(score(r.run))["recovered"]["detail"]


def test_missing_journal_or_record_is_a_clear_error(tmp_path):
    r = DrillRun(tmp_path / "hung", "hung-rank")
    with pytest.raises(ConfigError, match="journal.jsonl: missing: the run left no journal"):
        score(r.run)
    done = drill_cli("score", str(r.run.root))
    assert done.returncode == 2 and "journal.jsonl: missing" in done.stderr
    plain = RunDir(tmp_path / "plain").create()
    done = drill_cli("score", str(plain.root))
    assert done.returncode == 2
    assert "drill/drill.json: missing: not a drill's run directory" in done.stderr
    (plain.root / "drill").mkdir()
    record_file(plain).write_text("{torn")
    done = drill_cli("score", str(plain.root))
    assert done.returncode == 2 and "unreadable or not JSON" in done.stderr
    assert drill_cli("score", str(tmp_path / "nowhere")).returncode == 2
    atomic_write_json(record_file(plain), {**r.record, "drill": "fire-drill"})
    with pytest.raises(ConfigError, match="drill.json, key 'drill': unknown drill 'fire-drill'"):
        score(plain)


# --------------------------------------------------------------------------- processes

def test_stop_tree_stops_a_process_that_ignores_sigint_and_its_detached_child(tmp_path):
    """Like torchrun's ranks, the child runs in a session of its own; both ignore SIGINT."""
    script = tmp_path / "tree.py"
    script.write_text(
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)'], "
        "start_new_session=True)\n"
        f"open({str(tmp_path / 'child.pid')!r}, 'w').write(str(child.pid))\n"
        "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(script)], start_new_session=True)
    try:
        child = int(wait_for(lambda: (tmp_path / "child.pid").exists()
                             and (tmp_path / "child.pid").read_text(), 30, what="child"))
        started = time.time()
        stop_tree(proc, grace=1)
        assert time.time() - started < 15
        assert proc.returncode is not None
        assert not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_findings_watcher_keeps_what_a_real_agent_found(tmp_path):
    """A real agent watches a run whose rank 1 (a real sleeping process) has made no
    progress for a minute: the watcher finds the agent through the journal and keeps the
    stall finding with the agent's detected_at, once, however often it polls."""
    run = RunDir(tmp_path / "job").create()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    agent = None
    try:
        now = time.time()
        run.write_status(1, {"job": "job", "rank": 1, "local_rank": 1, "world_size": 2,
                             "node": node_name(), "pid": sleeper.pid, "state": "running", "step": 7,
                             "phase": "backward", "phase_since": now - 60,
                             "started_at": now - 90, "heartbeat_at": now,
                             "last_progress_at": now - 60})
        config = tmp_path / "agent.yaml"
        config.write_text("stall: {first_step_seconds: 1, floor_seconds: 1}\n"
                          "collectors:\n  ranks: {interval: 0.5}\n")
        agent, url = start_agent(tmp_path, "--run-dir", str(run.root), config=config)
        watcher = FindingsWatcher(run)
        watcher.poll()
        assert watcher.address is None and watcher.findings() == []  # no controller yet
        run.append_event("controller_started", "engine", agent=[url.removeprefix("http://")])

        def stalled():
            watcher.poll()
            return [f for f in watcher.findings() if f["kind"] == "stall"]

        (finding,) = wait_for(stalled, 30, what="a stall finding")
        assert finding["kind"] == "stall" and finding["rank"] == 1
        assert finding["id"] == "stall/job/1" and now < finding["detected_at"] <= time.time()
        watcher.poll()
        # the rank's finding and the run's one incident it belongs to, each kept once
        assert sorted(f["kind"] for f in watcher.findings()) == ["stall", "stall_incident"]
        assert watcher.errors == 0
    finally:
        if agent is not None:
            stop_process(agent)
        sleeper.kill()
        sleeper.wait()


# --------------------------------------------------------------------------- end to end

def start_drills(tmp_path, *args) -> subprocess.Popen:
    """`trainwatch drill run ... --json` for real (the reference trainer under torchrun,
    the agent and the embedded engine, started by `trainwatch run`), started: the test
    does something else while it runs."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "trainwatch", "drill", "run", *args,
                             "--out", str(tmp_path / "out"), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def drills_done(tmp_path, proc: subprocess.Popen, timeout=400):
    """The drills' output once ``proc`` ends; nothing it started may outlive it."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        kill_tree(proc)
        raise
    left = [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
            if str(tmp_path / "out") in " ".join(p.info["cmdline"] or [])]
    assert not left, f"processes outlived the drill: {left}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_sane(card, drill, *, action):
    assert card["passed"], json.dumps(card["criteria"], indent=1)
    assert card["fault_injected"]["step"] == drill.fault_step
    assert 0 <= card["detection"]["seconds"] <= drill.detect_within
    assert card["detection"]["seconds"] <= card["recovery"]["seconds"] <= drill.recover_within
    assert card["recovery"]["restarts"] == 1
    assert 0 <= card["steps"]["lost"] <= card["steps"]["lost_max"]
    assert card["steps"]["checkpoint_interval"] == 10
    assert card["steps"]["lost"] == drill.fault_step - card["recovery"]["resumed_from"]
    assert [a["action"] for a in card["actions"] if a["taken"]] == ([action] if action else [])
    assert card["run"]["exit_code"] == 0 and card["run"]["state"] == "finished"
    assert card["report"]["wall_seconds"] > 0 and card["report"]["incidents"]


@pytest.fixture(scope="module")
def real_drills(tmp_path_factory):
    """Six real drills side by side: their ranks mostly sleep (paced steps, a detection
    window) while the drill waits, so one trains while the others wait. The supervisor
    drills act on `trainwatch run` itself (0.2 s and 0.5 s a step); the deadline and
    timeout drills fail on purpose."""
    # two-supervisors: 40 steps, not the drill's 60: 25 paced steps (12.5 s) after the
    # fault step are still far more than a second supervisor takes to refuse.
    return side_by_side(tmp_path_factory, {
        "rank-killed": ("--keep",), "nan-batch": (),
        "supervisor-killed": ("--keep",), "two-supervisors": ("--keep", "--steps", "40"),
        "rank-crash": ("--detect-within", "0"),        # an impossible deadline
        "hung-rank": ("--timeout", "12")})             # no process may outlive it


@pytest.mark.slow
def test_rank_killed_drill_passes_for_real(real_drills):
    done = real_drills["rank-killed"].result()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(done.stdout)
    (card,) = data["drills"]
    assert_sane(card, catalog.get("rank-killed"), action=None)
    # The restart resumed from the ranks' memory snapshots, not from checkpoint 10: at most
    # the step in flight was lost (docs/memory-snapshots.md); the run's /dev/shm folder went
    # with the finished run.
    steps = card["steps"]
    assert card["recovery"]["by"] == "torchrun" and steps["resumed_from"] in (14, 15)
    assert steps["resumed_with"] == "memory snapshot" and steps["lost"] <= steps["lost_max"] == 1
    run = RunDir(card["run_dir"])
    (started,) = {e["root"] for e in run.events("memory_snapshots_started")}
    assert not Path(started).exists()
    assert "rank 1 killed by SIGKILL" in card["report"]["incidents"][0]["cause"]
    assert Path(card["run_dir"]).is_dir() and card["kept"]
    assert "rank-killed" in done.stderr  # the progress display, on stderr


def side_by_side(tmp_path_factory, drills: dict[str, tuple[str, ...]]) -> dict[str, Future]:
    """``trainwatch drill run NAME ARGS`` for each of ``drills`` at once, each in its own
    folder, its output drained by a thread: for drills whose ranks mostly sleep (paced
    steps), so one trains while the other waits. Each test asserts on its own drill's
    result (``.result()`` raises what ``drills_done`` raised)."""
    pool = ThreadPoolExecutor(len(drills))
    roots = {name: tmp_path_factory.mktemp(name) for name in drills}
    return {name: pool.submit(drills_done, roots[name], start_drills(roots[name], name, *args))
            for name, args in drills.items()}


@pytest.mark.slow
def test_supervisor_killed_drill_leaves_nothing_and_the_rerun_trains_one_job_for_real(
        real_drills):
    done = real_drills["supervisor-killed"].result()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (card,) = json.loads(done.stdout)["drills"]
    assert card["passed"], json.dumps(card["criteria"], indent=1)
    assert card["detection"]["first"] == catalog.SUPERVISOR_SIGNALS["tree-gone"]
    assert card["recovery"]["by"] == "rerun" and card["recovery"]["restarts"] == 1
    run = RunDir(card["run_dir"])
    assert len(run.events("controller_started")) == 2 and not run.events("leftovers_stopped")


@pytest.mark.slow
def test_two_supervisors_drill_refuses_the_second_for_real(real_drills):
    done = real_drills["two-supervisors"].result()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (card,) = json.loads(done.stdout)["drills"]
    assert card["passed"], json.dumps(card["criteria"], indent=1)
    assert card["detection"]["seconds"] < 45 and card["recovery"]["restarts"] == 0
    run = RunDir(card["run_dir"])
    assert len(run.events("controller_started")) == 1
    second = (run.drill_dir / "second.log").read_text()
    assert "already supervised by pid" in second and "Traceback" not in second


@pytest.mark.slow
def test_nan_batch_drill_rolls_back_and_passes_for_real(real_drills):
    done = real_drills["nan-batch"].result()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (card,) = json.loads(done.stdout)["drills"]
    assert_sane(card, catalog.get("nan-batch"), action="rollback_skip")
    assert card["detection"]["first"] == "alert TrainingLossNonFinite"
    assert card["recovery"]["by"] == "controller"
    assert not card["kept"] and not Path(card["run_dir"]).exists()  # passed, no --keep


def _last_digests(run_dir) -> dict[int, tuple[int, str]]:
    return {s["rank"]: (s["replicas"][-1]["step"], s["replicas"][-1]["bits"])
            for s in RunDir(run_dir).statuses().records}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sdc_drill_names_the_rank_rolls_back_and_ends_as_a_clean_run_for_real(
        tmp_path, launch_train):
    from conftest import finish

    drills = start_drills(tmp_path, "sdc", "--keep")
    # "Equals a clean run's": a run of the same config (the drill's train.yaml, copied), without
    # the flip, that also started afresh at checkpoint 20 (rank 0 exits in step 25; torchrun
    # restarts every rank; no memory snapshots, which would resume it at step 24).
    # DDP lays out its gradient buckets anew at each start and gloo's 3-way sums round by
    # bucket position, so only runs restarted at the same step are bitwise alike. It trains
    # while the drill's paced ranks sleep, once the drill's job has started (its config whole).
    try:
        drill_run = wait_for(lambda: next((RunDir(p.parent.parent) for p in (
            tmp_path / "out").glob("sdc-*/drill/train.yaml") if RunDir(
            p.parent.parent).events("job_started")), None), 120, what="the drill's job")
    except AssertionError:
        drills_done(tmp_path, drills)
        raise
    config = tmp_path / "train.yaml"
    config.write_bytes((drill_run.drill_dir / "train.yaml").read_bytes())
    clean = tmp_path / "clean"
    clean_proc = launch_train(
        "--nproc-per-node", "3", "--run-dir", str(clean), "--config", str(config),
        "--max-restarts", "1", "--set", "checkpoint.memory_snapshots=off",
        env={"TRAINWATCH_FAULT": "exit:rank=0:step=25", "OMP_NUM_THREADS": "1"})
    clean_done = ThreadPoolExecutor(1).submit(finish, clean_proc, 400)  # its pipe drained
    done = drills_done(tmp_path, drills)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (card,) = json.loads(done.stdout)["drills"]
    drill = catalog.get("sdc")
    assert_sane(card, drill, action="replica_rollback")
    assert card["settings"]["nproc_per_node"] == 3
    assert card["detection"]["first"] == "alert TrainingReplicaDivergence"
    assert [a["suspects"] for a in card["alerts"]] == ["1"]
    v = verdicts(card)
    steps = int(re.search(r"(\d+) steps after the fault", v["detected within steps"]["detail"])[1])
    assert 2 <= steps <= drill.detect_within_steps  # two digests, 5 steps apart, after step 22
    run = RunDir(card["run_dir"])
    (taken,) = run.events("action_taken")
    assert taken["action"] == "replica_rollback"
    assert taken["divergence"]["first_odd_step"] == 24
    assert taken["divergence"]["last_agreeing_step"] == 19
    assert [s["rank"] for s in taken["suspects"]] == [1]
    assert taken["clean_checkpoint_step"] == card["recovery"]["resumed_from"] == 20
    assert [r["step"] for r in run.events("checkpoint_resumed")] == [20]
    # Every checkpoint saved after the last agreeing digest, as many as the job had saved
    # when the alert acted (30 and 40 on an idle machine; a loaded one acts sooner).
    quarantined = {q["step"] for q in taken["quarantined"]}
    saved_after = {s for s in (30, 40) if s <= taken["step_before"]}
    assert saved_after <= quarantined <= {30, 40}, (quarantined, taken["step_before"])
    # The suspect's node is marked for preflight, which fails it until the record is removed.
    (marked,) = taken["marked"]
    record = json.loads(Path(marked).read_text())
    assert record["ranks"] == [1] and record["evidence"]["first_odd_step"] == 24
    assert Path(marked).parent == run.suspects_dir

    def preflight():
        done = subprocess.run([sys.executable, "-m", "trainwatch", "preflight", "--run-dir",
                               str(run.root), "--only", "sdc", "--json"],
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "TRAINWATCH_NODE": record["node"]})
        (check,) = [c for c in json.loads(done.stdout)["checks"] if c["id"] == "sdc.suspect"]
        return done.returncode, check
    code, check = preflight()
    assert code == 1 and check["status"] == "fail" and f"rm {marked}" in check["message"]
    Path(marked).unlink()
    code, check = preflight()
    assert code == 0 and check["status"] == "ok", check
    assert drill_run.root == run.root
    code, out = clean_done.result()
    assert code == 0, out[-3000:]
    assert [e["step"] for e in RunDir(clean).events("checkpoint_resumed")][-1:] == [20]
    final = _last_digests(run.root)
    assert set(final.values()) == set(_last_digests(clean).values())
    assert len(set(final.values())) == 1 and next(iter(final.values()))[0] == 59


@pytest.mark.slow
def test_a_drill_held_to_an_impossible_deadline_fails_with_exit_1(real_drills):
    done = real_drills["rank-crash"].result()
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    (card,) = json.loads(done.stdout)["drills"]
    v = verdicts(card)
    assert not v["detected"]["passed"] and "too late" in v["detected"]["detail"]
    assert card["detection"]["seconds"] > 0
    # Everything else about the drill worked: only the deadline failed it.
    assert all(c["passed"] for c in card["criteria"] if c["name"] != "detected"), \
        card["criteria"]
    assert card["recovery"]["by"] == "controller"
    assert [a["action"] for a in card["actions"] if a["taken"]] == ["restart"]
    assert card["kept"] and Path(card["run_dir"]).is_dir()  # failed drills keep evidence


@pytest.mark.slow
def test_a_drill_past_its_timeout_is_stopped_whole_and_fails(real_drills):
    done = real_drills["hung-rank"].result()
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    (card,) = json.loads(done.stdout)["drills"]
    assert card["run"]["timed_out"] and not card["passed"] and card["kept"]
    assert verdicts(card)["run finished"]["detail"].startswith("timed out")
    assert 12 <= card["run"]["seconds"] < 12 + 60 + 10


def test_a_job_wide_alert_in_the_scorecard_names_no_rank():
    """An alert without a rank label (job-wide) reads "fired", never "rank None"."""
    import io

    from rich.console import Console

    from trainwatch.drill.render import render_card

    card = {"name": "hung-rank", "passed": True, "run": {"seconds": 30.0}, "fault": "hang",
            "simulates": "a hung rank", "criteria": [], "settings": {}, "run_dir": "x",
            "alerts": [{"alert": "TrainingStalled", "rank": None, "seconds": 8.0},
                       {"alert": "TrainingRankDown", "rank": "1", "seconds": 9.0}],
            "actions": []}
    out = io.StringIO()
    render_card(card, Console(file=out, width=200))
    text = out.getvalue()
    assert "rank None" not in text
    assert "TrainingStalled fired +8.0 s" in text and "TrainingRankDown fired (rank 1)" in text
