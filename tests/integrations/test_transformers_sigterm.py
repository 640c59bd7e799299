"""The Hugging Face Trainer callback stopping a DDP job (2 CPU ranks under torchrun) that
one rank was asked to stop: the other rank carries the stop out and gets its launcher's
SIGTERM late, while it writes its final status. ``on_train_end`` gave SIGTERM back to the
default handler before that status, so the late signal killed the rank first: it stayed
'running' and torchrun saw -15, not 75. SIGTERM now stays the callback's to the exit."""

import importlib.util
from pathlib import Path

import pytest

from framework_helpers import stop_job
from trainwatch.checkpoint_format.manifest import verify
from trainwatch.rank.checkpoint.checkpointer import EXIT_STOPPED

pytestmark = pytest.mark.slow
JOB = Path(__file__).resolve().parent.parent / "jobs" / "hf_job.py"


def test_a_late_sigterm_while_closing_still_ends_both_ranks_stopped_exit_75(tmp_path):
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("not installed: transformers")
    run, text = stop_job(tmp_path, JOB, signal_torchrun=False, late=True)
    saved = run.events("checkpoint_saved")
    assert len(saved) == 1 and verify(saved[0]["path"]).ok, text[-3000:]
    assert {s["rank"]: s["state"] for s in run.statuses().records} == {
        0: "stopped", 1: "stopped"}, text[-3000:]
    assert f"exitcode  : {EXIT_STOPPED}" in text, text[-3000:]
