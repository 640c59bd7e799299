"""`trainwatch diagnose` against real faults in real gloo runs under torchrun.

Each test starts tests/jobs/diagnose_job.py (telemetry + flight recorder on), injects one
real fault (SIGSTOP, SIGKILL, a FIFO nobody writes, an extra collective, a full
tmpfs, a slow rank) and checks that diagnose names the culprit. The tests' jobs run three at
a time (tests/side_by_side.py).
"""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from agent_helpers import free_port, get_json, http_get, stop_process, wait_for
from conftest import REPO, tmpfs_mount
from diagnose_helpers import diagnose, jobs_in, stalled_for, top
from side_by_side import scenario, side_by_side

pytestmark = pytest.mark.slow



@contextlib.contextmanager
def agent(tmp_path):
    """A real `trainwatch agent` on 127.0.0.1 watching the test's run directory."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trainwatch", "agent", "--run-dir",
                             str(tmp_path / "run"), "--listen", f"127.0.0.1:{port}"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http_get(f"{url}/healthz"), 60, what="agent /healthz")
        yield url
    finally:
        stop_process(proc)


def _sigstop_rank_named_stuck_on_4_ranks_within_20s(start_job, agent, tmp_path):
    job = start_job(nproc=4)
    job.wait_step(10)
    os.kill(job.pid(2), signal.SIGSTOP)
    job.wait(stalled_for(3), "no progress for 3 s")
    # On a loaded machine a healthy rank may still be finishing its step: ask again until
    # every other rank waits in the collective (each diagnose must still be fast).
    deadline = time.monotonic() + 60
    while True:
        started = time.monotonic()
        code, report, _ = diagnose(job.run, "--stall-after", "2", "--agent", agent)
        elapsed = time.monotonic() - started
        print(f"diagnose on 4 ranks (one SIGSTOPped): {elapsed:.1f} s")
        assert elapsed < 20, f"diagnose took {elapsed:.1f} s on 4 ranks"
        finding = top(report)
        waits = [e for e in finding.get("evidence", []) if "wait in collective" in e]
        if (waits and "[0, 1, 3]" in waits[0]) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert code == 1
    assert finding["category"] == "rank_stuck" and finding["ranks"] == [2], finding
    assert "stopped" in finding["title"]
    waiting = next(e for e in finding["evidence"] if "wait in collective" in e)
    assert "[0, 1, 3]" in waiting and "gloo:all_" in waiting, finding["evidence"]
    assert finding["runbook"] == "TrainingStalled"
    assert any("diagnose_job.py" in line for line in finding["stack"]), finding["stack"]
    assert not [f for f in report["findings"] if f["category"] == "rank_stuck"
                and f["ranks"] != [2]]
    # The node's agent answered with its /status (docs/agent.md) and is part of the evidence.
    (node,) = report["evidence"]["agents"]
    assert node.get("error") is None and node["node"] == socket.gethostname()
    assert not [line for line in report["could_not_see"] if "agent" in line]
    # The same stall is one incident, and one TrainingStalled alert naming rank 2 with its
    # three waiting ranks, in the embedded engine and in a real Prometheus.
    # The agent judges on its own budget (a few seconds past diagnose's --stall-after).
    incidents = wait_for(lambda: [f for f in get_json(agent + "/status")["findings"]
                                  if f["kind"] == "stall_incident"],
                         60, interval=0.5, what="a stall incident in the agent's /status")
    assert len(incidents) == 1, incidents
    incident = incidents[0]
    assert incident["culprit_ranks"] == [2] and incident["stall_kind"] == "frozen", incident
    embedded = one_stall_alert_embedded(agent, tmp_path)
    assert embedded.labels["culprit_rank"] == "2" and embedded.value == 3, embedded
    if shutil.which("prometheus"):
        labels, value = one_stall_alert_prometheus(agent, tmp_path)
        assert labels["culprit_rank"] == "2" and float(value) == 3, (labels, value)


def one_stall_alert_embedded(agent_url: str, tmp_path: Path):
    """Scrape the agent into the embedded engine until TrainingStalled fires with all the
    waiting ranks counted; exactly one such alert."""
    from trainwatch.alerts.engine import Engine
    from trainwatch.alerts.evaluate import History
    from trainwatch.alerts.rules import load_rules
    from trainwatch.alerts.scrape import Scraper
    (tmp_path / "fast.yaml").write_text("stall_for: 0s\n")
    history = History()
    engine = Engine(load_rules(thresholds_file=tmp_path / "fast.yaml"), history)
    scraper = Scraper(history, [agent_url])
    deadline = time.time() + 60
    while time.time() < deadline:
        now = time.time()
        scraper.scrape_all(now)
        engine.evaluate(now)
        stalled = [a for a in engine.firing() if a.name == "TrainingStalled"]
        if stalled and stalled[0].value == 3:
            assert len(stalled) == 1, [a.labels for a in stalled]
            return stalled[0]
        time.sleep(1)
    raise AssertionError(f"embedded engine: {[(a.labels, a.value) for a in engine.firing()]}")


def one_stall_alert_prometheus(agent_url: str, tmp_path: Path):
    """A real Prometheus scraping the agent with the exported rules: exactly one alert."""
    rules = tmp_path / "rules.yaml"
    out = subprocess.run([sys.executable, "-m", "trainwatch", "alerts", "export", "--thresholds",
                          str(tmp_path / "fast.yaml"), "-o", str(rules)], capture_output=True,
                         text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: [{rules}]
scrape_configs:
  - job_name: trainwatch-agent
    honor_labels: true
    static_configs: [{{targets: ['{agent_url.removeprefix("http://")}']}}]
""")
    log = open(tmp_path / "prometheus.log", "wb")
    prom = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'prom-data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        def firing():
            try:
                alerts = get_json(f"http://127.0.0.1:{port}/api/v1/alerts")["data"]["alerts"]
            except (OSError, ValueError):
                return None
            stalled = [a for a in alerts if a["labels"]["alertname"] == "TrainingStalled"
                       and a["state"] == "firing"]
            return stalled if stalled and float(stalled[0]["value"]) == 3 else None
        stalled = wait_for(firing, 90, what="TrainingStalled firing in Prometheus")
        assert len(stalled) == 1, stalled
        return stalled[0]["labels"], stalled[0]["value"]
    finally:
        stop_process(prom)
        log.close()




def _rank_blocked_in_data_loading(start_job, tmp_path, flight_recorder):
    fifo = tmp_path / "never-written.fifo"
    os.mkfifo(fifo)
    job = start_job(FAULT="data_fifo", FAULT_RANK="1", FAULT_STEP="12", FAULT_ARG=str(fifo),
                    TORCH_FR_BUFFER_SIZE="2000" if flight_recorder else "0")
    job.wait(lambda s: s[1]["phase"] == "data" and (s[1]["step"] or 0) >= 12
             and time.time() - s[0]["last_progress_at"] > 3, "rank 1 stuck in data")
    code, report, _ = diagnose(job.run, "--stall-after", "2")
    assert code == 1
    finding = top(report)
    assert finding["category"] == "rank_stuck" and finding["ranks"] == [1], finding
    assert "outside a collective, in data loading" in finding["title"]
    assert any("__getitem__" in line for line in finding["stack"]), finding["stack"]
    cause = finding["cause"]  # the kernel: blocked in open() of a FIFO no one writes
    assert cause["kind"] == "fifo_open" and cause["path"] == str(fifo), cause
    assert cause["peers"] == [] and cause["thread"]["wchan"], cause
    assert "no other process has it open" in finding["title"]
    if flight_recorder:
        assert finding["confidence"] == "high"
        assert any("[0] wait in collective" in e for e in finding["evidence"]), finding
    else:  # without the flight recorder: from stacks, and it says what it could not see
        assert finding["confidence"] == "medium"
        assert any("[0] are inside a torch.distributed call" in e for e in finding["evidence"])
        assert any("flight recorder disabled" in line for line in report["could_not_see"])


def _kernel_causes_flock_holder_and_thread_deadlock(start_job, tmp_path):
    """Rank 1 waits for an flock another process holds, rank 2's threads deadlock on two
    locks, rank 0 waits for both in the all_reduce: the kernel and the source name why."""
    lock_path = tmp_path / "shared.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)",
         str(lock_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        job = start_job(nproc=3, FAULT="flock", FAULT_RANK="1", FAULT_STEP="8",
                        FAULT_ARG=str(lock_path), DEADLOCK_RANK="2")
        job.wait(lambda s: all(r["step"] == 8 for r in s.values()) and stalled_for(2)(s),
                 "ranks 1 and 2 blocked at step 8")
        code, report, _ = diagnose(job.run, "--stall-after", "1")
    finally:
        holder.kill()
        holder.wait()
    assert code == 1
    stuck = {f["ranks"][0]: f for f in report["findings"] if f["category"] == "rank_stuck"}
    assert set(stuck) == {1, 2}, [f["title"] for f in report["findings"]]
    flock = stuck[1]["cause"]
    assert flock["kind"] == "file_lock" and flock["path"] == str(lock_path), flock
    assert flock["holder"]["pid"] == holder.pid and "fcntl.flock" in flock["holder"]["cmdline"]
    assert flock["thread"]["wchan"] and flock["runbook"] == "TrainingStalled#file-lock"
    assert f"held by pid {holder.pid}" in stuck[1]["title"], stuck[1]["title"]
    assert any("innermost Python line" in e and "fcntl.flock(lock_file" in e
               for e in stuck[1]["evidence"]), stuck[1]["evidence"]
    deadlock = stuck[2]["cause"]
    assert deadlock["kind"] == "deadlock", deadlock
    pairs = {(t["thread"]["name"], t["waits_for"], t["held_by"]["name"])
             for t in deadlock["threads"]}
    assert pairs == {("MainThread", "LOCK_B", "cache-refresher"),
                     ("cache-refresher", "LOCK_A", "MainThread")}, pairs
    assert all(t["kernel"] and "futex" in t["kernel"] for t in deadlock["threads"]), deadlock
    assert "deadlock: thread" in stuck[2]["title"]


def _extra_collective_is_a_desync_at_the_right_sequence_number(start_job):
    step = 15
    job = start_job(FAULT="extra_collective", FAULT_RANK="1", FAULT_STEP=str(step))
    job.wait(lambda s: all(r["step"] == step for r in s.values()) and stalled_for(2)(s),
             "both ranks hung at the extra collective")
    code, report, _ = diagnose(job.run, "--stall-after", "1")
    assert code == 1
    finding = top(report)
    # One gradient all_reduce per step plus the telemetry exchange's two all_reduces (its
    # sketch's sums, its extremes) after every 5th step.
    expected_seq = step + 2 * (step // 5) + 1
    assert finding["category"] == "collective_desync", finding
    assert f"sequence number {expected_seq} " in finding["title"]
    assert finding["ranks"] == [1]
    ops = " ".join(finding["evidence"])
    assert "rank 1: gloo:barrier" in ops and "rank 0: gloo:all_reduce" in ops, ops


def _collective_mismatch_abort_blames_the_aborting_rank_or_says_tie(start_job):
    """Rank 1 all-reduces a bigger tensor; gloo aborts the receiving rank (SIGABRT) and
    torchrun SIGTERMs the other. torchrun's root cause decides; without its log the last
    heartbeats may be a tie, never a confident wrong answer."""
    job = start_job(FAULT="size_mismatch", FAULT_RANK="1", FAULT_STEP="8")
    job.proc.wait(timeout=120)
    code, report, _ = diagnose(job.run, "--stall-after", "1")
    assert code == 1
    dead = top(report, "rank_dead")
    root = report["evidence"]["launcher"]["root_cause"]
    assert root["exitcode"] == -6 and dead["ranks"] == [root["rank"]], (root, dead)
    assert dead["confidence"] == "high" and "root cause" in " ".join(dead["evidence"])
    assert any("stopped the others" in e and "SIGTERM" in e for e in dead["evidence"])
    (job.run.root / "logs").rename(job.run.root / "logs.away")  # no launcher evidence now
    code, report, _ = diagnose(job.run, "--stall-after", "1")
    blamed = top(report, "rank_dead")
    if len(blamed["ranks"]) > 1:
        assert "tie" in blamed["title"] and blamed["confidence"] in ("low", "medium"), blamed
    else:
        assert blamed["ranks"] == [root["rank"]] and blamed["confidence"] != "high", blamed


def _sigkilled_rank_is_dead(start_job):
    job = start_job()
    job.wait_step(8)
    os.kill(job.pid(1), signal.SIGKILL)
    job.proc.wait(timeout=60)
    code, report, _ = diagnose(job.run)
    assert code == 1
    finding = top(report)
    assert finding["category"] == "rank_dead" and finding["ranks"] == [1], finding
    assert any("SIGKILL" in e for e in finding["evidence"]), finding["evidence"]
    assert finding["runbook"] == "TrainingRankDown"
    assert not [f for f in report["findings"] if f["category"] == "rank_dead"
                and f["ranks"] != [1]]


@contextlib.contextmanager
def full_tmpfs(tmp_path):
    with tmpfs_mount(tmp_path / "run" / "checkpoints", "1m") as mount:
        yield mount


def _checkpoints_on_a_full_tmpfs(start_job, full_tmpfs):
    job = start_job(steps=40, FAULT="checkpoint", FAULT_ARG="5")
    assert job.proc.wait(timeout=120) == 0, job.tail()
    code, report, _ = diagnose(job.run)
    assert code == 1
    storage = top(report, "storage")
    assert storage["runbook"] == "StorageFull" and str(full_tmpfs) in storage["title"]
    checkpoint = top(report, "checkpoint")
    assert checkpoint["runbook"] == "CheckpointFailed"
    assert any("No space left" in e for e in checkpoint["evidence"]), checkpoint["evidence"]
    saved = sorted(int(p.name.split("-")[1]) for p in full_tmpfs.glob("step-*[0-9]"))
    newest = report["evidence"]["checkpoints"]["newest"]
    assert saved and newest["step"] == saved[-1] and newest["source"] == "manifest"


def _slow_rank_is_a_straggler_not_a_stall(start_job):
    job = start_job(FAULT="slow", FAULT_RANK="1", FAULT_ARG="0.1")
    job.wait_step(25)
    code, report, _ = diagnose(job.run)
    assert code == 1
    categories = {f["category"] for f in report["findings"]}
    assert not categories & {"rank_stuck", "stalled", "rank_dead", "collective_desync"}
    finding = top(report, "straggler")
    assert finding["ranks"] == [1] and finding["runbook"] == "TrainingStragglerRank", finding


SECRETS = {"WANDB_API_KEY": "planted-env-secret-9f8e7d", "hf_token": "planted-config-secret-1a2b",
           "log": "planted-log-secret-77aa"}


def _healthy_run_exits_0_and_secrets_never_leak(start_job, tmp_path):
    job = start_job(WANDB_API_KEY=SECRETS["WANDB_API_KEY"])
    job.run.write_run_info({"job": "healthy", "world_size": 2,
                            "config": {"hf_token": SECRETS["hf_token"], "lr": 0.01}})
    (job.run.logs_dir / "app.log").write_text(
        f"connecting to the tracker with password={SECRETS['log']}\n")
    job.wait_step(15)
    bundle_file = tmp_path / "evidence.tar.gz"
    code, report, output = diagnose(job.run, "--bundle", str(bundle_file))
    assert code == 0, [f["title"] for f in report["findings"]]
    assert report["verdict"] == "healthy" and top(report)["category"] == "healthy"
    human = subprocess.run([sys.executable, "-m", "trainwatch", "diagnose", "--run-dir",
                            str(job.run.root)], capture_output=True, text=True, cwd=REPO,
                           timeout=60)
    assert human.returncode == 0 and "healthy" in human.stdout
    with tarfile.open(bundle_file) as tar:
        members = {m.name.split("/", 1)[1]: tar.extractfile(m).read().decode()
                   for m in tar.getmembers()}
    assert {"report.json", "report.txt", "run.json", "environment/rank-00000.json",
            "logs/app.log"} <= set(members)
    assert "[REDACTED]" in members["environment/rank-00000.json"]
    assert "[REDACTED]" in members["run.json"] and "[REDACTED]" in members["logs/app.log"]
    for secret in SECRETS.values():
        assert secret not in output and secret not in human.stdout + human.stderr
        for name, text in members.items():
            assert secret not in text, f"{secret} leaked into {name}"


def test_bad_usage_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "trainwatch", "diagnose", "--run-dir",
                           str(tmp_path / "missing")], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "no such run directory" in proc.stderr


def _reference_trainer_hang_is_found_with_ddp(start_job):
    """The real trainer (DDP, its own launcher) with TRAINWATCH_FAULT=hang on rank 1."""
    job = start_job(trainer=True, TRAINWATCH_FAULT="hang:rank=1:step=4")
    job.wait(lambda s: s[1]["step"] == 4 and stalled_for(3)(s), "rank 1 hung at step 4")
    code, report, _ = diagnose(job.run, "--stall-after", "2")
    assert code == 1
    finding = top(report)
    assert finding["category"] == "rank_stuck" and finding["ranks"] == [1], finding
    assert "outside a collective" in finding["title"]
    assert any("[0] wait in collective" in e for e in finding["evidence"]), finding["evidence"]
    assert any("faults.py" in line for line in finding["stack"]), finding["stack"]


# --------------------------------------------------------------------------- side by side

WITH = {"start_job": jobs_in, "agent": agent, "full_tmpfs": full_tmpfs}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Three jobs at a time: most of a test is waiting for its fault to show."""
    with side_by_side(request, tmp_path_factory, {
        "test_sigstop_rank_named_stuck_on_4_ranks_within_20s":
            scenario(_sigstop_rank_named_stuck_on_4_ranks_within_20s, WITH),
        "test_rank_blocked_in_data_loading[fr]":
            scenario(_rank_blocked_in_data_loading, WITH, flight_recorder=True),
        "test_rank_blocked_in_data_loading[stacks-only]":
            scenario(_rank_blocked_in_data_loading, WITH, flight_recorder=False),
        "test_kernel_causes_flock_holder_and_thread_deadlock":
            scenario(_kernel_causes_flock_holder_and_thread_deadlock, WITH),
        "test_reference_trainer_hang_is_found_with_ddp":
            scenario(_reference_trainer_hang_is_found_with_ddp, WITH),
        "test_slow_rank_is_a_straggler_not_a_stall":
            scenario(_slow_rank_is_a_straggler_not_a_stall, WITH),
        "test_checkpoints_on_a_full_tmpfs": scenario(_checkpoints_on_a_full_tmpfs, WITH),
        "test_sigkilled_rank_is_dead": scenario(_sigkilled_rank_is_dead, WITH),
        "test_collective_mismatch_abort_blames_the_aborting_rank_or_says_tie":
            scenario(_collective_mismatch_abort_blames_the_aborting_rank_or_says_tie, WITH),
        "test_extra_collective_is_a_desync_at_the_right_sequence_number":
            scenario(_extra_collective_is_a_desync_at_the_right_sequence_number, WITH),
        "test_healthy_run_exits_0_and_secrets_never_leak":
            scenario(_healthy_run_exits_0_and_secrets_never_leak, WITH),
    }, at_once=3) as running:
        yield running


def test_sigstop_rank_named_stuck_on_4_ranks_within_20s(runs, request):
    runs.result(request)


@pytest.mark.parametrize("flight_recorder", [True, False], ids=["fr", "stacks-only"])
def test_rank_blocked_in_data_loading(runs, request, flight_recorder):
    runs.result(request)


def test_kernel_causes_flock_holder_and_thread_deadlock(runs, request):
    runs.result(request)


def test_extra_collective_is_a_desync_at_the_right_sequence_number(runs, request):
    runs.result(request)


def test_collective_mismatch_abort_blames_the_aborting_rank_or_says_tie(runs, request):
    runs.result(request)


def test_sigkilled_rank_is_dead(runs, request):
    runs.result(request)


def test_checkpoints_on_a_full_tmpfs(runs, request):
    runs.result(request)


def test_slow_rank_is_a_straggler_not_a_stall(runs, request):
    runs.result(request)


def test_healthy_run_exits_0_and_secrets_never_leak(runs, request):
    runs.result(request)


def test_reference_trainer_hang_is_found_with_ddp(runs, request):
    runs.result(request)
