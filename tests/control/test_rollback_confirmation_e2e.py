"""`trainwatch run` of a job that crashes before its first checkpoint and starts over
from scratch: TrainingLossSpike fires on the new launch's losses against the old one's,
and the supervisor does not roll back (control/bad_step.py); the old code did, naming a
"bad step" of the new launch and restarting the job for nothing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import kill_tree

JOB = Path(__file__).resolve().parents[1] / "jobs" / "restart_from_scratch_job.py"


@pytest.mark.slow
def test_a_spike_across_a_restart_from_scratch_is_not_rolled_back(tmp_path):
    thresholds = tmp_path / "thresholds.yaml"
    thresholds.write_text("evaluation_interval: 1s\nloss_spike_window: 10s\n"
                          "loss_spike_keep_firing: 10s\naction_min_interval_seconds: 0\n")
    run_dir, state = tmp_path / "run", tmp_path / "state"
    state.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainwatch", "run", "--run-dir", str(run_dir), "--no-live",
         "--thresholds", str(thresholds), "--", sys.executable, str(JOB), str(state)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)})
    try:
        out = proc.communicate(timeout=240)[0].decode(errors="replace")
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, out[-3000:]
    events = [json.loads(line) for line in (run_dir / "journal.jsonl").read_text().splitlines()]
    starts = [e["time"] for e in events if e.get("event") == "rank_started"]
    assert len(starts) == 2, out[-3000:]  # the first launch and the crash restart, no more
    fired = [e for e in events if e.get("event") == "alert_firing"
             and e.get("alert") == "TrainingLossSpike"]
    assert fired and fired[0]["time"] >= starts[1], fired  # on the new launch's losses
    skipped = [e for e in events if e.get("event") == "action_skipped"
               and e.get("action") == "rollback_skip"]
    assert skipped and all("not confirmed" in e["reason"] for e in skipped), skipped
    taken = [e.get("action") for e in events if e.get("event") == "action_taken"]
    assert taken == ["restart"], taken
