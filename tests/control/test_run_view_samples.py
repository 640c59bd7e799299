"""A job that records samples= but no tokens= (an image or tabular model) sees its
throughput in `trainwatch run`'s view and progress lines, not a dash."""

import time

from rich.console import Console

from trainwatch.alerts.engine import Engine
from trainwatch.alerts.evaluate import History
from trainwatch.alerts.rules import load_rules
from trainwatch.control.run_view import Progress, live_view
from trainwatch.rundir.run_dir import RunDir


def _status(run, rank, metrics):
    run.write_status(rank, {"rank": rank, "pid": 100 + rank, "state": "running", "step": 9,
                            "phase": "forward", "metrics": {"step": 9, "loss": 0.5, **metrics}})


def test_samples_per_second_shown_when_no_tokens(tmp_path):
    run = RunDir(tmp_path / "exp").create()
    _status(run, 0, {"samples_per_second": 7394.0})
    _status(run, 1, {"tokens_per_second": 1234.0, "samples_per_second": 12.0})
    progress = Progress(target=None).update(run)
    assert "7,394 samples/s" in progress.line()
    console = Console(width=120, record=True, force_terminal=False)
    console.print(live_view(run, Engine(load_rules(None, None), History()), progress,
                            time.time(), "http://127.0.0.1:9"))
    text = console.export_text()
    assert "7,394 samples/s" in text
    assert "1,234 tokens/s" in text               # tokens stay first when both are there
