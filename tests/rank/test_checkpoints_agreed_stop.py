"""A job-wide stop that one rank was asked for (SIGTERM on one node) is carried out by every
rank, also by a rank whose own SIGTERM (its launcher's, when the other node's supervisor is
stopped a moment later) lands while it saves or writes its final status: that SIGTERM is the
first this rank got, not a second ask, so it must not kill the rank before it records
``stopped`` (a multi-node Ctrl-C left node 1's ranks ``running``, or killed them mid-save)."""

import json

import pytest

from conftest import run_torchrun
from trainwatch.rank.checkpoint import EXIT_STOPPED
from trainwatch.rundir.run_dir import RunDir


@pytest.mark.slow
def test_a_rank_stopping_on_an_agreed_stop_outlives_its_own_sigterm(tmp_path):
    """Rank 0 asked; rank 1's own SIGTERM lands in the stop's save, rank 2's in its close."""
    run_dir = tmp_path / "run"
    done = run_torchrun(tmp_path, "tests/jobs/agreed_stop_job.py", str(run_dir), nproc=3)
    said = done.stdout[-3000:] + done.stderr[-3000:]
    run = RunDir(run_dir)
    states = {s["rank"]: s["state"] for s in run.statuses().records}
    assert states == {0: "stopped", 1: "stopped", 2: "stopped"}, said
    for rank in (0, 1, 2):
        assert f"rank {rank}: stopped on request after saving step 1" in done.stderr, said
    assert not run.events("failed"), said
    (saved,) = run.events("checkpoint_saved")
    assert saved["step"] == 1 and saved["reason"] == "stop", json.dumps(saved)
    # torchrun reports the first failed worker: exit 75 (stopped after a save), not -15
    assert f"exitcode: {EXIT_STOPPED}" in done.stderr and "exitcode: -15" not in done.stderr, said
