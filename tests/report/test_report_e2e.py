"""`trainwatch report` on real runs: `trainwatch train` with two gloo ranks under torchrun, one
run whose rank 1 is SIGKILLed mid-run (torchrun restarts both ranks, they resume from the
last checkpoint and finish), one clean run. The report's numbers are checked against the
journal and the metrics log, not against constants."""

import collections
import json
import subprocess
import sys

import pytest

from conftest import finish
from trainwatch.report.goodput import CATEGORIES
from trainwatch.rundir.run_dir import RunDir

ARGS = ["--nproc-per-node", "2", "--set", "checkpoint.every_steps=10",
        "--set", "train.eval_interval=10", "--set", "data.corpus_bytes=20000",
        "--set", "telemetry.heartbeat_interval=0.2", "--set", "checkpoint.fsync=false"]


def report_json(run_dir):
    done = subprocess.run([sys.executable, "-m", "trainwatch", "report", str(run_dir), "--json"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def assert_accounts_for_the_wall_time(data):
    assert sum(data["categories"][c] for c in CATEGORIES) == pytest.approx(
        data["time"]["wall_seconds"], abs=1e-6)
    assert 0 < data["goodput_ratio"] < 1
    assert data["goodput_ratio"] <= data["effective_training_time_ratio"] < 1


@pytest.mark.slow
def test_a_sigkilled_rank_costs_one_incident_and_the_steps_since_the_checkpoint(
        tmp_path, launch_train):
    """Memory snapshots off: the restart resumes at the durable checkpoint, so the steps
    since it run twice and are booked as recomputed (a resume from memory or a dying gasp
    recomputes at most one: the drills' scorecards book those from the journal)."""
    run_dir = tmp_path / "run"
    code, out = finish(launch_train("--run-dir", str(run_dir), *ARGS, "--steps", "30",
                                    "--max-restarts", "1",
                                    "--set", "checkpoint.memory_snapshots=off",
                                    env={"TRAINWATCH_FAULT": "kill:rank=1:step=15"}))
    assert code == 0, out[-3000:]
    run = RunDir(run_dir)
    (fault,) = run.events("fault_injected")
    saved_before = [e["step"] for e in run.events("checkpoint_saved")
                    if e["time"] < fault["time"] and not e.get("copy")]
    expected_lost = fault["step"] - max(saved_before, default=0)
    # Cross-check with rank 0's metrics log: the steps it completed twice.
    steps = [r["step"] for r in run.metrics(0).records if r.get("kind") == "step"]
    twice = sorted(s for s, n in collections.Counter(steps).items() if n == 2)
    assert len(twice) == expected_lost

    data = report_json(run_dir)
    assert_accounts_for_the_wall_time(data)
    (incident,) = data["incidents"]
    assert incident["steps_lost"] == expected_lost == data["steps"]["recomputed"]
    assert incident["lost_steps"] == {"first": twice[0], "last": twice[-1]}
    assert incident["resumed_from"] == max(saved_before, default=0)
    assert "rank 1 killed by SIGKILL" in incident["cause"], incident
    assert incident["restart_downtime_seconds"] > 0 and incident["recomputed_seconds"] > 0
    assert data["steps"]["unique"] == 30 and data["state"] == "finished"
    assert [a["outcome"] for a in data["attempts"]] == ["interrupted", "finished"]
    assert data["skipped"] == {"journal_lines": 0, "metrics_lines": 0, "examples": []}

    text = subprocess.run([sys.executable, "-m", "trainwatch", "report", str(run_dir),
                           "--gpu-hour-price", "2"], capture_output=True, text=True, timeout=60)
    assert text.returncode == 0 and "SIGKILL" in text.stdout and "goodput" in text.stdout


@pytest.mark.slow
def test_a_clean_run_has_no_incident_and_recomputes_nothing(tmp_path, launch_train):
    run_dir = tmp_path / "run"
    code, out = finish(launch_train("--run-dir", str(run_dir), *ARGS, "--steps", "20",
                                    "--max-restarts", "0"))
    assert code == 0, out[-3000:]
    data = report_json(run_dir)
    assert_accounts_for_the_wall_time(data)
    assert data["incidents"] == []
    assert data["steps"]["recomputed"] == 0 and data["steps"]["unique"] == 20
    assert data["categories"]["recomputed"] == 0 == data["categories"]["restart_downtime"]
    assert data["categories"]["checkpoint"] > 0 and data["categories"]["evaluation"] > 0
