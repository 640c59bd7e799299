"""`trainwatch run -- torchrun ... examples/own_loop.py`: a user's own DDP loop (not the
reference trainer) under the whole safety net, with real torchrun, signals and agent.

SIGKILL a rank -> restarted, resumed, the same final weights as an uninterrupted run;
SIGSTOP a rank -> stall alert, evidence, restart, finished; a NaN batch -> rollback past
it, its steps skipped, finished; Ctrl-C -> a checkpoint, then nothing left running.
`trainwatch report` reads the finished runs: no incident in a clean one, the world size,
and the stall the controller killed counted as stalled time; the clean run's summary
shows the loss the loop logged last. Runs are shared between assertions to keep the
suite short.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import kill_tree
from trainwatch.rundir.run_dir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("trainwatch.agent.daemon") is None, reason="needs the agent")]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_loop.py"
STEPS = 60


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("own-loop-configs")
    (folder / "thresholds.yaml").write_text(
        "evaluation_interval: 1s\nstall_for: 2s\naction_min_interval_seconds: 30\n")
    (folder / "agent.yaml").write_text(
        "stall: {floor_seconds: 3, k: 10, first_step_seconds: 300}\n"
        "collectors:\n  ranks: {interval: 0.5}\n")
    return folder


def _start(configs, run_dir, *job_args, steps=STEPS):
    cmd = [sys.executable, "-m", "trainwatch", "run", "--run-dir", str(run_dir), "--no-live",
           "--thresholds", str(configs / "thresholds.yaml"),
           "--agent-config", str(configs / "agent.yaml"), "--",
           "torchrun", "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
           "--steps", str(steps), "--checkpoint-every", "10", *job_args]
    log = open(Path(run_dir).with_suffix(".log"), "wb")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _finish(proc, run_dir, timeout):
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        raise
    return code, Path(run_dir).with_suffix(".log").read_text()[-3000:]


def _digest(run_dir):
    out = subprocess.run([sys.executable, "-m", "trainwatch", "checkpoint", "digest",
                          str(run_dir)], capture_output=True, text=True, check=True)
    return out.stdout.split()[0]


def _report(run_dir):
    out = subprocess.run([sys.executable, "-m", "trainwatch", "report", str(run_dir), "--json"],
                         capture_output=True, text=True)
    assert out.returncode in (0, 1), out.stderr
    return json.loads(out.stdout)


def _actions(run, action):
    return [e for e in run.events("action_taken") if e.get("action") == action]


class Drive:
    """One run and what the test does to it once a rank reaches a step."""

    def __init__(self, configs, root, name, *job_args, steps=STEPS, rank=1, at=None, act=None):
        self.name, self.rank, self.at, self.act = name, rank, at, act
        self.run = RunDir(root / name)
        self.proc = _start(configs, self.run.root, *job_args, steps=steps)
        self.done_at = None if act else 0
        self.tree: list[psutil.Process] = []
        self.ranks: list[int] = []
        self.code = self.log = None

    def poke(self):
        if self.done_at is not None or self.proc.poll() is not None:
            return
        status = {s["rank"]: s for s in self.run.statuses().records}
        mine = status.get(self.rank, {})
        if mine.get("step") is not None and mine["step"] >= self.at and mine.get("state") == "running":
            self.ranks = [s["pid"] for s in status.values()]
            self.tree = psutil.Process(self.proc.pid).children(recursive=True)
            self.act(self, mine["pid"])
            self.done_at = mine["step"]


@pytest.fixture(scope="module")
def runs(configs, tmp_path_factory):
    """Five runs side by side (most of their time is spent waiting for a signal to be seen):
    uninterrupted; a NaN batch; a rank SIGKILLed; a rank SIGSTOPped; Ctrl-C."""
    root = tmp_path_factory.mktemp("own-loop")
    drives = [
        Drive(configs, root, "clean"),
        Drive(configs, root, "nan", "--poison-step", "25", "--pace", "0.2"),
        Drive(configs, root, "killed", "--pace", "0.1", at=25,
              act=lambda d, pid: os.kill(pid, signal.SIGKILL)),
        Drive(configs, root, "stalled", "--pace", "0.1", at=25,
              act=lambda d, pid: os.kill(pid, signal.SIGSTOP)),
        Drive(configs, root, "interrupted", "--pace", "0.1", steps=5000, rank=0, at=15,
              act=lambda d, pid: d.proc.send_signal(signal.SIGINT)),
    ]
    try:
        deadline = time.time() + 420
        while time.time() < deadline and any(d.proc.poll() is None for d in drives):
            for d in drives:
                d.poke()
            time.sleep(0.1)
        for d in drives:
            d.code, d.log = _finish(d.proc, d.run.root, timeout=max(1, deadline - time.time()))
        return {d.name: d for d in drives}
    finally:
        for d in drives:
            kill_tree(d.proc)


def test_clean_finish_has_no_incident_and_a_known_world_size(runs):
    clean = runs["clean"]
    assert clean.code == 0, clean.log
    report = _report(clean.run.root)
    assert report["state"] == "finished" and report["world_size"] == 2
    assert report["incidents"] == [], report["incidents"]
    info = clean.run.run_info()
    assert info["world_size"] == 2 and "torchrun" in info["command"] and info["started_at"]
    # The summary ends with the loss the loop logged last, not `final loss -` (only the
    # reference trainer journals its own).
    last = [r["loss"] for r in clean.run.metrics(0).records if "loss" in r][-1]
    summary = clean.run.root.with_suffix(".log").read_text()
    assert f"final loss  │ {last:.4f}" in summary, summary[-3000:]


def test_nan_batch_is_rolled_back_skipped_and_the_run_finishes(runs):
    nan = runs["nan"]
    assert nan.code == 0, nan.log
    run = nan.run
    rollback = _actions(run, "rollback_skip")
    assert len(rollback) == 1, run.events("action_taken", "action_skipped")
    details = rollback[0]
    assert details["bad_step"] == 25 and details["resume_step"] == 20
    assert all(q["step"] >= 25 for q in details["quarantined"])
    skipped = run.events("data_skipped")
    assert skipped and 25 in skipped[-1]["steps"]
    assert run.events("finished")
    assert "no checkpoint found" not in details["reason"]
    # The poisoned weights were never saved: the good checkpoints stayed for the rollback.
    assert any(e.get("policy") == "nonfinite" for e in run.events("checkpoint_skipped"))


def test_killed_rank_restarts_resumes_and_ends_with_the_uninterrupted_weights(runs):
    killed = runs["killed"]
    assert killed.done_at is not None and killed.code == 0, killed.log
    run = killed.run
    # torchrun's exit (restart) or, on a loaded machine, the survivor stuck in its
    # all-reduce seen first (stall_restart): either way one restart.
    restarts = _actions(run, "restart") + _actions(run, "stall_restart")
    assert len(restarts) == 1 and restarts[0]["resume_from"]["kind"] == "checkpoint"
    assert "resumes from its newest complete checkpoint" in restarts[0]["reason"]
    resumed = [e for e in run.events("checkpoint_resumed") if e.get("rank") == 0]
    assert resumed and resumed[-1]["step"] >= 20
    assert _digest(run.root) == _digest(runs["clean"].run.root)


def test_stopped_rank_is_detected_restarted_and_counted_as_stalled(runs):
    stalled = runs["stalled"]
    assert stalled.done_at is not None and stalled.code == 0, stalled.log
    run = stalled.run
    assert any(e.get("alert") == "TrainingStallSuspected" for e in run.events("alert_firing"))
    stall = _actions(run, "stall_restart")
    assert len(stall) == 1
    evidence = Path(stall[0]["evidence"])
    assert (evidence / "py-spy-rank-00001.txt").exists()
    assert run.events("finished")
    report = _report(run.root)
    assert report["state"] == "finished"
    assert sum(i["stalled_seconds"] for i in report["incidents"]) > 0, report["incidents"]


def test_ctrl_c_saves_a_checkpoint_and_leaves_nothing_running(runs):
    interrupted = runs["interrupted"]
    assert interrupted.done_at is not None and interrupted.code == 130, interrupted.log
    from trainwatch.checkpoint_format.catalog import complete
    newest = complete(interrupted.run.checkpoint_dir)[0]
    assert newest.manifest["reason"] == "stop" and newest.step >= interrupted.done_at
    assert interrupted.tree and not [p for p in interrupted.tree if p.is_running()
                                     and p.status() != psutil.STATUS_ZOMBIE]
    assert not [pid for pid in interrupted.ranks if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
