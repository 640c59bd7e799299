"""The executions a run's accounting counts: those no later attempt threw away.

The step log is read a chunk at a time (a few thousand executions), so the report's
memory stays flat in the run's length; report/goodput.py adds up what these give.
"""

from __future__ import annotations

import itertools
from typing import Iterator

import numpy as np

from trainwatch.report.steplog import StepLog

CHUNK = 1 << 13  # executions per temporary array: memory stays flat in the run's length
VALUES_CHUNK = 1 << 12  # floats made at once from the tokens column


def kept_rows(log: StepLog, cuts: list[tuple[int, int, int]]
              ) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(lo, rows, mask) over the step log in chunks: the executions no later attempt threw
    away (exactly those ``paint_steps`` did not count as recomputed)."""
    for lo, rows in log.chunks(0, len(log), CHUNK):
        hi = lo + len(rows)
        keep = np.ones(hi - lo, dtype=bool)
        steps = rows["step"]
        for a, b, earliest in cuts:
            if a < hi and b > lo:
                part = slice(max(a, lo) - lo, min(b, hi) - lo)
                keep[part] &= steps[part] < earliest
        yield lo, rows, keep


def distinct(log: StepLog, cuts: list[tuple[int, int, int]], first: int, last: int) -> int:
    """How many distinct step numbers the kept executions hold: marked in a bitmap (a bit
    per number) when the numbers span little more than the log (as they do), else sorted."""
    if last - first < 4 * len(log) + 4096:
        seen = np.zeros((last - first) // 8 + 1, dtype=np.uint8)
        for _, rows, keep in kept_rows(log, cuts):
            at = rows["step"][keep] - first
            np.bitwise_or.at(seen, at >> 3, np.left_shift(1, at & 7).astype(np.uint8))
        return int(np.bitwise_count(seen).sum())
    return int(np.unique(np.concatenate([rows["step"][keep]
                                         for _, rows, keep in kept_rows(log, cuts)])).size)


def values(log: StepLog, cuts: list[tuple[int, int, int]], *, kept: bool,
           scale: tuple[np.ndarray, np.ndarray]) -> Iterator[float]:
    """The tokens of the kept executions (or of all), each times its attempt's factor
    (``scale``: the attempts' first indices and factors), a few thousand floats at a time."""
    starts, factors = scale

    def parts() -> Iterator[tuple[np.ndarray, float]]:
        for lo, rows, keep in kept_rows(log, cuts):  # an attempt's executions are contiguous
            hi = lo + len(rows)
            attempt = max(0, int(np.searchsorted(starts, lo, "right")) - 1)
            while attempt < len(starts) and starts[attempt] < hi:
                a = max(lo, int(starts[attempt]))
                b = min(hi, int(starts[attempt + 1]) if attempt + 1 < len(starts) else hi)
                part = rows["tokens"][a - lo:b - lo]
                yield (part[keep[a - lo:b - lo]] if kept else part), float(factors[attempt])
                attempt += 1

    return itertools.chain.from_iterable((part[i:i + VALUES_CHUNK] * factor).tolist()
                                         for part, factor in parts()
                                         for i in range(0, len(part), VALUES_CHUNK))
