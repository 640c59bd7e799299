"""The non-finite guard across real ranks: a NaN on one rank skips the step on every rank."""

import json

import pytest

from conftest import run_torchrun
from trainwatch.rundir.run_dir import RunDir


@pytest.mark.slow
def test_nan_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    run_dir = tmp_path / "run"
    RunDir(run_dir).create()
    done = run_torchrun(tmp_path, "tests/jobs/checkpoint_nan_job.py", str(run_dir))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [json.loads((run_dir / f"result-rank-{r}.json").read_text()) for r in (0, 1)]
    assert [r["applied"] for r in results] == [[0, 1, 2, 4]] * 2
    assert results[0]["weights"] == results[1]["weights"]   # the replicas never diverged
    events = {e["rank"]: e for e in RunDir(run_dir).events("nonfinite_detected")}
    assert events[0]["step"] == 3 and events[0]["this_rank_bad"] is False
    assert events[1]["this_rank_bad"] is True and events[1]["ranks_affected"] == 1
    assert events[1]["action"] == "skipped" and events[1]["data_position"] == {"batch": 4}
