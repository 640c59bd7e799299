"""The HTML report's time series: bounded however long the run, and still right."""

import json

from trainwatch.report.html import _broken_at
from trainwatch.report.series import MAX_BUCKETS, MAX_POINTS, read_series
from trainwatch.rundir.run_dir import RunDir


def _write_metrics(run, rank, steps, seconds):
    with open(run.metrics_file(rank), "w") as fh:
        for step in range(steps):
            fh.write(json.dumps({"v": 1, "kind": "step", "step": step, "time": 1000.0 + step,
                                 "rank": rank, "step_time_seconds": seconds(step),
                                 "loss": 10.0 - step / steps}) + "\n")
        fh.write("{torn line\n")


def test_a_long_run_is_downsampled_as_it_is_read(tmp_path):
    run = RunDir(tmp_path / "exp").create()
    steps = 50_000
    _write_metrics(run, 0, steps, lambda s: 0.5)
    _write_metrics(run, 1, steps, lambda s: 2.0 if s >= steps // 2 else 0.5)  # straggles late
    series = read_series(run)
    assert 0 < len(series.loss) <= MAX_POINTS
    assert series.stride > 1
    assert series.loss[-1][1] == steps - 1                      # reaches the last step
    assert all(abs(p[3] - 0.5) < 1e-9 for p in series.loss)     # means of equal values
    assert 0 < len(series.heatmap_steps) <= MAX_BUCKETS
    assert series.heatmap_ranks == [0, 1]
    row0, row1 = series.heatmap
    assert all(abs(v - 0.5) < 1e-9 for v in row0)
    assert abs(row1[0] - 0.5) < 1e-9 and abs(row1[-1] - 2.0) < 1e-9   # the straggler shows


def test_lines_break_at_restarts():
    points = [[1.0, 0, 5.0, 0.1], [2.0, 1, 4.0, 0.1], [10.0, 1, 4.1, 0.1], [11.0, 2, 3.9, 0.1]]
    out = _broken_at(points, [5.0])
    assert out[2] == [None, None, None, None] and len(out) == 5
