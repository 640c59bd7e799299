"""Rank 0's steps go to a temporary file a block at a time (report/steplog.py): the report's
memory must not grow with the run's length, and nothing read back may differ from what
was held in memory before (the median step time exactly as ``np.median`` computes it)."""

import json
import random
import tracemalloc

import numpy as np
import pytest

from trainwatch.report import goodput, kept_steps, steplog, timeline
from trainwatch.rundir.run_dir import RunDir


def _log(seconds: list[float], ends: list[float] | None = None) -> steplog.StepLog:
    log = steplog.StepLog()
    t = 0.0
    for i, s in enumerate(seconds):
        t = ends[i] if ends is not None else t + s
        log.append(i, t - s, t, 0.0, None if i % 3 else 512.0)
    log.sort()
    return log


@pytest.mark.parametrize("block", [4, 1 << 16])
@pytest.mark.parametrize("seed", range(8))
def test_median_and_rows_read_back_exactly(monkeypatch, seed, block):
    """Odd and even counts, repeated values, a step of no time, values that share all but
    their last bits: the median is np.median's to the bit, rows read back as written."""
    monkeypatch.setattr(steplog, "BLOCK", block)
    monkeypatch.setattr(steplog, "READ", max(block // 2, 1))
    rng = random.Random(seed)
    n = rng.choice([1, 2, 3, 10, 11, 257])
    pool = [0.0, 0.1, 0.1 + 2**-50, 1.0, 15.0, rng.uniform(0, 2)]
    seconds = [rng.choice(pool) if rng.random() < 0.5 else rng.uniform(0, 3) for _ in range(n)]
    log = _log(seconds)
    rows = log.rows(0, len(log))
    spent = rows["end"] - rows["start"]
    assert log.median_seconds() == float(np.median(spent))
    assert log.rows(0, len(log)).tobytes() == rows.tobytes()
    assert [log.step[i] for i in range(n)] == list(range(n))
    assert log.end[-1] == rows["end"][-1]
    assert list(timeline.StepRange(log, 0, n).step_numbers()) == list(range(n))
    if n > block:
        assert len(log.tail[0]) < block  # the rest is in the file


def test_an_out_of_order_log_is_sorted_across_blocks(monkeypatch):
    """Ends that disagree with the order written (clocks, writers) are sorted by end time,
    stably, wherever the blocks fell."""
    monkeypatch.setattr(steplog, "BLOCK", 3)
    ends = [5.0, 1.0, 3.0, 3.0, 9.0, 2.0, 8.0, 7.0]
    log = _log([0.5] * len(ends), ends)
    assert [log.end[i] for i in range(len(ends))] == sorted(ends)
    assert [log.step[i] for i in range(len(ends))] == [1, 5, 2, 3, 0, 7, 6, 4]
    assert len(log.tail[0]) < 3


def test_steps_stay_in_memory_where_no_temporary_file_can_be_written(monkeypatch, tmp_path):
    """A full or read-only $TMPDIR costs memory, not the report: the rows stay in memory
    and the report's warnings say why."""
    monkeypatch.setattr(steplog, "BLOCK", 4)

    def refuse(**_kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(steplog.tempfile, "TemporaryFile", refuse)
    run = _run(tmp_path / "run", 40)
    tl = timeline.read_timeline(RunDir(run))
    assert len(tl.steps) == 40 and len(tl.steps.tail[0]) == 40
    assert any("held in memory" in w and "Permission denied" in w for w in tl.warnings)
    assert goodput.account(tl).unique_steps == 40


def _run(root, steps: int):
    run = RunDir(root).create()
    run.write_run_info({"job": "long", "world_size": 1, "nproc_per_node": 1})
    t = 1_800_000_000.0
    run.journal_file.write_text(json.dumps({"v": 1, "time": t, "event": "rank_started",
                                            "source": "rank0", "host": "h", "rank": 0,
                                            "pid": 5, "restart_count": 0}) + "\n")
    with open(run.metrics_file(0), "w") as fh:
        for step in range(steps):
            fh.write(json.dumps({"v": 1, "kind": "step", "step": step, "rank": 0,
                                 "time": t + 0.1 * (step + 1), "step_time_seconds": 0.1,
                                 "data_wait_seconds": 0.001, "tokens": 64}) + "\n")
    return root


def _bytes(run) -> tuple[int, int]:
    """(held once the run is read, the peak while it is read and accounted)."""
    tracemalloc.start()
    try:
        tl = timeline.read_timeline(RunDir(run))
        held = tracemalloc.get_traced_memory()[0]
        goodput.account(tl)
        return held, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_reports_memory_does_not_grow_with_the_runs_length(tmp_path, monkeypatch):
    """Eight times the steps, the same memory held and the same peak within 4 bytes a
    step: what the columns held in memory (40 bytes a step and numpy's copies) now lies
    in the file."""
    monkeypatch.setattr(goodput, "_STEP_CHUNK", 256)
    for name in ("CHUNK", "VALUES_CHUNK"):
        monkeypatch.setattr(kept_steps, name, 256)
    monkeypatch.setattr(steplog, "BLOCK", 256)
    monkeypatch.setattr(steplog, "READ", 256)
    short, long = _run(tmp_path / "short", 2_000), _run(tmp_path / "long", 16_000)
    _bytes(short)  # imports and caches, once
    (held_short, peak_short), (held_long, peak_long) = _bytes(short), _bytes(long)
    assert held_long - held_short < 4 * 14_000, (held_short, held_long)
    assert peak_long - peak_short < 4 * 14_000, (peak_short, peak_long)
