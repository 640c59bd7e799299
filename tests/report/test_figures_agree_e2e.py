"""One run, the same figures from every command (issue #24 item 12): a real `trainwatch run`
with two gloo ranks whose rank 1 exits at step 15 on the first launch, on torchrun's first
attempt and again on its restart; torchrun gives up, the controller starts a new torchrun
(restart count 0 again) and it finishes. diagnose and report must tell the same story."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import torchrun_env
from trainwatch.rundir.run_dir import RunDir

pytestmark = pytest.mark.slow

STEPS = 30


@pytest.fixture(scope="module")
def restarted_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("figures")
    (tmp / "train.yaml").write_text(
        f"train: {{steps: {STEPS}, batch_size: 4, eval_interval: 1000}}\n"
        "checkpoint: {every_steps: 10, fsync: false}\n")
    run_dir = tmp / "exp"
    done = subprocess.run(
        [sys.executable, "-m", "trainwatch", "run", "--nproc-per-node", "2", "--run-dir",
         str(run_dir), "--config", str(tmp / "train.yaml"), "--max-restarts", "1", "--no-live"],
        env=torchrun_env(tmp, TRAINWATCH_FAULT="exit:rank=1:step=15:attempt=any:launch=1"),
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (tmp / "summary.txt").write_text(done.stdout)  # the run's closing summary
    return run_dir


def _cli(*args):
    done = subprocess.run([sys.executable, "-m", "trainwatch", *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode in (0, 1), done.stderr[-3000:]
    return done.stdout


def test_diagnose_and_report_count_the_same_attempts_and_restarts(restarted_run):
    run = RunDir(restarted_run)
    # What happened, from the journal itself: one torchrun restart, one controller restart.
    assert len(run.events("restarted")) == 1
    assert [e["attempt"] for e in run.events("job_started")] == [1, 2]
    expected = {"attempts": 3, "restarts": 2,
                "restarted_by": {"torchrun": 1, "controller": 1, "rerun": 0}}

    report = json.loads(_cli("report", str(restarted_run), "--json"))
    diagnose = json.loads(_cli("diagnose", str(restarted_run), "--json"))
    assert report["restarts"] == expected
    assert [a["restarted_by"] for a in report["attempts"]] == [None, "torchrun", "controller"]
    assert diagnose["evidence"]["journal"]["restarts"] == expected

    words = "attempts 3 (2 restarts: 1 by torchrun, 1 by the controller)"
    assert words in _cli("report", str(restarted_run))
    assert words in _cli("diagnose", str(restarted_run))


def test_diagnose_and_report_count_the_steps_completed_as_the_run_summary(restarted_run):
    run = RunDir(restarted_run)
    (finished,) = run.events("finished")
    assert finished["step"] == STEPS - 1 and finished["steps_completed"] == STEPS
    newest = max(e["step"] for e in run.events("checkpoint_saved"))
    assert newest == STEPS  # a checkpoint's step counts the steps completed

    report = json.loads(_cli("report", str(restarted_run), "--json"))
    diagnose = json.loads(_cli("diagnose", str(restarted_run), "--json"))
    assert report["steps"]["completed"] == report["steps"]["unique"] == STEPS
    ranks = diagnose["evidence"]["ranks"]
    assert {r["step"] for r in ranks.values()} == {STEPS - 1}  # the step it was in, last
    assert {r["steps_completed"] for r in ranks.values()} == {STEPS}

    label = f"{STEPS} steps completed"
    assert label in _cli("report", str(restarted_run))
    assert f"{STEPS} of {STEPS} completed" in (restarted_run.parent / "summary.txt").read_text()
    assert f"{STEPS - 1} ({STEPS} completed)" in _cli("diagnose", str(restarted_run))


def test_every_output_names_the_two_config_digests_alike(restarted_run):
    run = RunDir(restarted_run)
    info = run.run_info()
    weights, whole = info["weights_config_digest"], info["config_digest"]
    assert weights != whole  # two different things, by two names
    listed = json.loads(_cli("checkpoint", "list", str(restarted_run), "--json"))
    assert listed and {c["weights_config_digest"] for c in listed} == {weights}
    for entry in listed:
        manifest = json.loads((Path(entry["path"]) / "manifest.json").read_text())
        assert manifest["weights_config_digest"] == weights and "config_hash" not in manifest
    report = json.loads(_cli("report", str(restarted_run), "--json"))
    assert report["digests"] == {"config_digest": whole, "weights_config_digest": weights}
    assert {s["info"]["config_digest"] for s in run.statuses().records} == {whole}
