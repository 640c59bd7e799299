"""A DCP checkpoint the job declared, as `trainwatch run` tells it: the summary counts it
(not "checkpoints none"), and a restart's journal never claims it is a trainwatch
checkpoint the job verifies as it loads."""

import io

from rich.console import Console

from dcp_helpers import declare, save_dcp
from trainwatch.control.controller import JobController
from trainwatch.control.outcome import Ending, RunOutcome
from trainwatch.control.run_summary import render, summarize
from trainwatch.rundir.run_dir import RunDir


def _run_with_dcp(tmp_path) -> RunDir:
    run = RunDir(tmp_path / "run").create()
    for step in (2, 4):
        path = run.checkpoint_dir / f"step-{step:08d}"
        save_dcp(path)
        declare(run.root, path, step)
    return run


def test_the_summary_counts_declared_dcp_checkpoints(tmp_path):
    run = _run_with_dcp(tmp_path)
    summary = summarize(run, RunOutcome(Ending.FINISHED))
    out = io.StringIO()
    render(summary, Console(file=out, width=200))
    (row,) = [line for line in out.getvalue().splitlines() if "checkpoints" in line]
    assert "2, newest at step 4 (DCP, declared by the job)" in row, out.getvalue()


def test_a_restart_resumes_from_a_declared_dcp_checkpoint_not_a_verified_one(tmp_path):
    run = _run_with_dcp(tmp_path)
    controller = JobController(run.root, ["true"])
    assert controller.resume_point() == (4, "declared")
    assert controller.progress_step() == 4  # still progress for the restart guard

