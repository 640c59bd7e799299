"""A run that trained on after its saves failed ends saying why the save failed: the
failure's own reason from the journal, not a guess at the disk. Before, the line always
asked "(is the disk full?)", which sent the on-call to the disk when the state itself
could not be saved."""

from checkpoint_helpers import failed_saves
from trainwatch.control.launch_log import LaunchLog
from trainwatch.control.outcome import Ending, RunOutcome
from trainwatch.control.run_summary import unsaved_end
from trainwatch.errors import EXIT_PROBLEM
from trainwatch.rundir.run_dir import RunDir


def _end_line(run: RunDir) -> str | None:
    why = unsaved_end(run)
    assert why is not None
    return RunOutcome(Ending.UNSAVED, EXIT_PROBLEM, why).message(run, LaunchLog(run, 0))


def test_the_end_names_the_last_failed_saves_reason_not_a_full_disk(tmp_path):
    run = failed_saves(tmp_path / "run")
    line = _end_line(run)
    assert line is not None and line.startswith(
        "trainwatch run: the job ended, but its checkpoint save of step 4 failed: [Errno 20] "
        "saving checkpoint step 4 failed: Not a directory"), line
    assert "the newest saved is none" in line and "disk full" not in line, line


def test_a_failure_with_no_reason_recorded_says_so_before_guessing(tmp_path):
    run = RunDir(tmp_path / "run").create()
    run.append_event("checkpoint_saved", "rank0", rank=0, step=10, path="x")
    run.append_event("checkpoint_failed", "rank0", rank=0, step=20)
    assert unsaved_end(run) == ("its checkpoint save of step 20 failed: no reason recorded "
                                "(is the disk full?); the newest saved is step 10")
