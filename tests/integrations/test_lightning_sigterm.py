"""Lightning DDP (2 CPU ranks under torchrun) stopped the way Slurm stops a job: SIGTERM to
every process of the step at once, so each rank gets it twice within milliseconds (its own,
and torchrun's forward). Lightning's SIGTERM handler runs a broadcast inside the handler;
the second one landed in the middle of the callback's stop save, the ranks' collectives
no longer matched and a rank died ("Connection reset by peer"): nothing saved. The
callback now takes SIGTERM itself (no collective in a handler, a repeat within 2 s is the
same stop), saves and exits 75 like ``Checkpoints``."""

import importlib.util
from pathlib import Path

import pytest

from framework_helpers import stop_job
from trainwatch.checkpoint_format.manifest import verify
from trainwatch.rank.checkpoint.checkpointer import EXIT_STOPPED

pytestmark = pytest.mark.slow
JOB = Path(__file__).resolve().parent.parent / "jobs" / "lightning_job.py"


def _stop(tmp_path, signal_torchrun, late=False):
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("not installed: lightning")
    return stop_job(tmp_path, JOB, signal_torchrun=signal_torchrun, late=late)


def test_sigterm_to_every_process_of_the_step_saves_once(tmp_path):
    run, text = _stop(tmp_path, signal_torchrun=True)
    saved = run.events("checkpoint_saved")
    assert [e["reason"] for e in saved] == ["stop"], text[-3000:]
    assert verify(saved[0]["path"]).ok
    assert {s["state"] for s in run.statuses().records} == {"stopped"}, text[-3000:]
    assert "Connection reset by peer" not in text


def test_the_ranks_exit_75_stopped_resume_me_not_0_finished(tmp_path):
    """Lightning's own SIGTERMException exits 0, which `trainwatch run` reads as a finished
    job: it would not be restarted to resume. Rank 0 alone is asked; rank 1 carries the stop
    out and gets its own (its launcher's) SIGTERM while it writes its final status: the
    callback had given SIGTERM back to Lightning's handler, whose broadcast inside the
    handler left rank 1 'running' (exit -15 or a broken collective)."""
    run, text = _stop(tmp_path, signal_torchrun=False, late=True)
    assert [e["reason"] for e in run.events("checkpoint_saved")] == ["stop"], text[-3000:]
    assert {s["rank"]: s["state"] for s in run.statuses().records} == {
        0: "stopped", 1: "stopped"}, text[-3000:]
    assert f"exitcode  : {EXIT_STOPPED}" in text, text[-3000:]
