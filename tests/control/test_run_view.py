"""`trainwatch run`'s live view and progress lines, drawn from a real run directory's files."""

import time

from rich.console import Console

from trainwatch.alerts.engine import Engine
from trainwatch.alerts.evaluate import History
from trainwatch.alerts.rules import load_rules
from trainwatch.control.run_view import Progress, live_view
from trainwatch.rundir.run_dir import RunDir


def _status(run, rank, step, loss, tps, phase="forward"):
    run.write_status(rank, {"rank": rank, "pid": 100 + rank, "state": "running", "step": step,
                            "phase": phase, "metrics": {"step": step, "loss": loss,
                                                        "tokens_per_second": tps}})


def _draw(run, progress, engine):
    console = Console(width=120, record=True, force_terminal=False)
    console.print(live_view(run, engine, progress.update(run), time.time(), "http://127.0.0.1:9"))
    return console.export_text()


def test_view_starts_with_a_startup_state_then_shows_progress_with_eta(tmp_path):
    run = RunDir(tmp_path / "exp").create()
    engine = Engine(load_rules(None, None), History())
    progress = Progress(target=100)
    text = _draw(run, progress, engine)
    assert "starting" in text and "None" not in text
    assert "http://127.0.0.1:9" in text          # where the agent listens
    assert "no alerts" in text

    _status(run, 0, 9, 3.5, 900.0)
    _status(run, 1, 9, 3.5, 910.0)
    progress.update(run, now=1000.0)              # first sight: step 10 done
    _status(run, 0, 19, 3.1, 1200.0)
    _status(run, 1, 19, 3.1, 1210.0)
    progress.update(run, now=1010.0)              # 10 steps in 10 s: 80 to go, 80 s
    assert progress.eta_seconds(now=1010.0) == 80.0
    assert progress.line().startswith("step 20/100 (20 %) · loss 3.1000")
    text = _draw(run, progress, engine)
    assert "step 20/100" in text and "ETA" in text


def test_columns_keep_their_width_as_values_grow(tmp_path):
    run = RunDir(tmp_path / "exp").create()
    engine = Engine(load_rules(None, None), History())
    progress = Progress(target=10**6)

    def header_and_row(step, loss, tps):
        _status(run, 0, step, loss, tps)
        lines = _draw(run, progress, engine).splitlines()
        i = next(i for i, ln in enumerate(lines) if ln.strip().startswith("rank"))
        return lines[i], lines[i + 2]

    small = header_and_row(1, 3.0, 5.0)
    large = header_and_row(123456, 12345.6789, 9876543.0)
    assert small[0] == large[0]                   # the header did not move
    assert len(small[1].rstrip()) <= len(large[1].rstrip()) == len(small[0].rstrip())


def test_after_a_restart_the_progress_line_waits_for_the_new_ranks_not_the_dead_ones(tmp_path):
    """`--no-live` prints a line every 10 s: after a restart the dead ranks' statuses stay
    until the new ranks publish, and must not be repeated as the job's progress."""
    run = RunDir(tmp_path / "exp").create()
    progress = Progress(target=100)
    for rank in (0, 1):
        run.write_status(rank, {"rank": rank, "pid": 100 + rank, "state": "running",
                                "step": 53, "started_at": 1000.0,
                                "metrics": {"step": 53, "loss": 0.071}})
    assert progress.update(run, now=1100.0, since=1000.0).line().startswith("step 54/100")
    restarted = 1200.0  # the job's new start: rank 1's old status is still there
    run.write_status(0, {"rank": 0, "pid": 200, "state": "running", "step": None,
                         "started_at": 1201.0, "metrics": {}})
    line = progress.update(run, now=1205.0, since=restarted).line()
    assert line == "starting: waiting for the first training step", line
    for rank in (0, 1):
        run.write_status(rank, {"rank": rank, "pid": 200 + rank, "state": "running",
                                "step": 49, "started_at": 1201.0,
                                "metrics": {"step": 49, "loss": 0.09}})
    assert progress.update(run, now=1210.0, since=restarted).line().startswith(
        "step 50/100 (50 %) · loss 0.0900")


def test_a_job_that_goes_on_with_fewer_ranks_shows_their_progress_not_the_lost_ones(tmp_path):
    """A node of a 4-rank job is lost and torchrun goes on with 2 ranks (--nnodes 1:2): the
    lost ranks 2 and 3 keep their last statuses (step 29) and must not hold the line there."""
    run = RunDir(tmp_path / "exp").create()
    progress = Progress(target=600)
    for rank in (2, 3):
        run.write_status(rank, {"rank": rank, "world_size": 4, "state": "running",
                                "started_at": 1000.0, "metrics": {"step": 29}})
    for rank in (0, 1):
        run.write_status(rank, {"rank": rank, "world_size": 2, "state": "running",
                                "started_at": 1050.0, "metrics": {"step": 120}})
    assert progress.update(run, now=1100.0, since=900.0).line().startswith("step 121/600")
