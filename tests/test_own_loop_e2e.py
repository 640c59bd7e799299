"""`trainwatch run -- torchrun ... examples/own_loop.py`: a user's own DDP loop (not the
reference trainer) under the whole safety net, with real torchrun, signals and agent.

SIGKILL a rank -> restarted, resumed, the same final weights as an uninterrupted run;
SIGSTOP a rank -> stall alert, evidence, restart, finished; a NaN batch -> rollback past
it, its steps skipped, finished; Ctrl-C -> a checkpoint, then nothing left running.
`trainwatch report` reads the finished runs: no incident in a clean one, the world size,
and the stall the controller killed counted as stalled time. Runs are shared between
assertions to keep the suite short.
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
from trainwatch.rundir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("trainwatch.agent.daemon") is None, reason="needs the agent")]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "own_loop.py"
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


def _finish(proc, run_dir, timeout=300):
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        raise
    return code, Path(run_dir).with_suffix(".log").read_text()[-3000:]


def _wait_for_step(run, rank, step, proc, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        status = {s["rank"]: s for s in run.statuses().records}
        current = status.get(rank, {}).get("step")
        if current is not None and current >= step and status[rank].get("state") == "running":
            return status[rank]
        assert proc.poll() is None, "trainwatch run ended before the job reached the step"
        time.sleep(0.1)
    raise AssertionError(f"rank {rank} did not reach step {step}")


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


@pytest.fixture(scope="module")
def finished_runs(configs, tmp_path_factory):
    """An uninterrupted run and one fed a NaN batch, side by side."""
    root = tmp_path_factory.mktemp("own-loop")
    clean, nan = root / "clean", root / "nan"
    procs = {clean: _start(configs, clean), nan: _start(configs, nan, "--poison-step", "25", "--pace", "0.2")}
    try:
        return {path: _finish(proc, path) for path, proc in procs.items()}, clean, nan
    finally:
        for proc in procs.values():
            kill_tree(proc)


def test_clean_finish_has_no_incident_and_a_known_world_size(finished_runs):
    results, clean, _ = finished_runs
    code, log = results[clean]
    assert code == 0, log
    report = _report(clean)
    assert report["state"] == "finished" and report["world_size"] == 2
    assert report["incidents"] == [], report["incidents"]
    info = RunDir(clean).run_info()
    assert info["world_size"] == 2 and "torchrun" in info["command"] and info["started_at"]


def test_nan_batch_is_rolled_back_skipped_and_the_run_finishes(finished_runs):
    results, _, nan = finished_runs
    code, log = results[nan]
    assert code == 0, log
    run = RunDir(nan)
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


def test_killed_rank_restarts_resumes_and_ends_with_the_uninterrupted_weights(
        configs, finished_runs, tmp_path):
    _, clean, _ = finished_runs
    run = RunDir(tmp_path / "killed")
    proc = _start(configs, run.root, "--pace", "0.1")
    try:
        victim = _wait_for_step(run, 1, 25, proc)
        os.kill(victim["pid"], signal.SIGKILL)
        code, log = _finish(proc, run.root)
    finally:
        kill_tree(proc)
    assert code == 0, log
    restarts = _actions(run, "restart")
    assert len(restarts) == 1 and restarts[0]["resume_from"]["kind"] == "checkpoint"
    assert "resumes from its newest complete checkpoint" in restarts[0]["reason"]
    resumed = [e for e in run.events("checkpoint_resumed") if e.get("rank") == 0]
    assert resumed and resumed[-1]["step"] >= 20
    assert _digest(run.root) == _digest(clean)


def test_stopped_rank_is_detected_restarted_and_counted_as_stalled(configs, tmp_path):
    run = RunDir(tmp_path / "stalled")
    proc = _start(configs, run.root, "--pace", "0.1")
    try:
        victim = _wait_for_step(run, 1, 25, proc)
        os.kill(victim["pid"], signal.SIGSTOP)
        code, log = _finish(proc, run.root)
    finally:
        kill_tree(proc)
    assert code == 0, log
    assert any(e.get("alert") == "TrainingStalled" for e in run.events("alert_firing"))
    stall = _actions(run, "stall_restart")
    assert len(stall) == 1
    evidence = Path(stall[0]["evidence"])
    assert (evidence / "py-spy-rank-00001.txt").exists()
    assert run.events("finished")
    report = _report(run.root)
    assert report["state"] == "finished"
    assert sum(i["stalled_seconds"] for i in report["incidents"]) > 0, report["incidents"]


def test_ctrl_c_saves_a_checkpoint_and_leaves_nothing_running(configs, tmp_path):
    run = RunDir(tmp_path / "interrupted")
    proc = _start(configs, run.root, "--pace", "0.1", steps=5000)
    try:
        _wait_for_step(run, 0, 15, proc)
        ranks = [s["pid"] for s in run.statuses().records]
        tree = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGINT)
        code, log = _finish(proc, run.root, timeout=120)
    finally:
        kill_tree(proc)
    assert code == 130, log
    from trainwatch.trainer.checkpoint.catalog import complete
    newest = complete(run.checkpoint_dir)[0]
    assert newest.manifest["reason"] == "stop" and newest.step >= 15
    assert not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not [pid for pid in ranks if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
