"""Rank 0's completed steps as five columns (step, start, end, data wait, tokens), held
in a temporary file rather than in memory.

A report reads a million-step log once and then walks its steps a few times (the
accounting, the survivors' count); held in memory, the columns were 40 bytes a step and
the report's peak grew with the run. Here whole blocks of ``BLOCK`` rows go to an
unlinked temporary file (``$TMPDIR``) as they fill, and every reader takes them back
``READ`` rows at a time (``rows``, ``chunks``; one such window is cached for the scattered
look-ups of single steps), so memory stays a few blocks whatever the run's length. Where no
temporary file can be written the rows stay in memory (``spill_error`` says why). A log
whose end times are out of order (clocks or writers that disagree) is sorted in memory:
the one case that holds every row at once.
"""

from __future__ import annotations

import itertools
import math
import tempfile
from array import array
from typing import Any, Iterator

import numpy as np

ROW = np.dtype([("step", "<i8"), ("start", "<f8"), ("end", "<f8"), ("wait", "<f8"),
                ("tokens", "<f8")])
FIELDS = ("step", "start", "end", "wait", "tokens")
BLOCK = 1 << 16   # rows written at a time: 2.5 MiB
READ = 1 << 13    # rows read back at a time (and cached for single look-ups): 320 KiB


class StepLog:
    """Rank 0's completed steps (index order = end time once ``sort``ed)."""

    def __init__(self) -> None:
        # The rows not yet written out; ``append`` targets (their bound ``append``s stay
        # valid: ``spill`` empties them in place).
        self.tail: tuple[Any, ...] = tuple(array("q" if name == "step" else "d")
                                           for name in FIELDS)
        self.attempt_starts: list[int] = [0]  # first index of each attempt's steps
        self.spill_error: str | None = None
        self._file: Any = None  # an unlinked temporary file, once a block is full
        self._written = 0                       # rows in the file
        self._cache: tuple[int, np.ndarray] | None = None  # (block number, its rows)
        self.step, self.start, self.end, self.wait, self.tokens = (
            _Column(self, name) for name in FIELDS)

    def __len__(self) -> int:
        return self._written + len(self.tail[0])

    def append(self, step: int, start: float, end: float, wait: float,
               tokens: float | None) -> None:
        add_step, add_start, add_end, add_wait, add_tokens = (c.append for c in self.tail)
        add_step(step)  # first: OverflowError leaves the columns as they were
        add_start(start)
        add_end(end)
        add_wait(wait)
        add_tokens(math.nan if tokens is None else tokens)
        self.maybe_spill()

    def maybe_spill(self) -> None:
        """Write the rows held in memory out once they make a block."""
        if len(self.tail[0]) >= BLOCK and self.spill_error is None:
            self._spill()

    def _spill(self) -> None:
        rows = np.empty(len(self.tail[0]), dtype=ROW)
        for name, column in zip(FIELDS, self.tail):
            rows[name] = np.frombuffer(column, dtype=ROW[name])
        try:
            if self._file is None:
                self._file = tempfile.TemporaryFile(prefix="trainwatch-report-")
            self._file.seek(self._written * ROW.itemsize)
            self._file.write(rows.tobytes())
            self._file.flush()
        except OSError as exc:  # a full or read-only $TMPDIR: keep the rows in memory
            self.spill_error = f"{tempfile.gettempdir()}: {exc.strerror or exc}"
            return
        self._written += len(rows)
        for column in self.tail:
            del column[:]

    # -- reading
    def rows(self, lo: int, hi: int) -> np.ndarray:
        """Rows lo..hi (a structured array of ``ROW``; a copy)."""
        lo, hi = max(lo, 0), min(hi, len(self))
        if hi <= lo:
            return np.empty(0, dtype=ROW)
        parts = []
        if lo < self._written:
            parts.append(self._read(lo, min(hi, self._written)))
        if hi > self._written:
            parts.append(self._tail_rows(max(lo, self._written) - self._written,
                                         hi - self._written))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def chunks(self, lo: int = 0, hi: int | None = None, size: int | None = None
               ) -> Iterator[tuple[int, np.ndarray]]:
        """(first index, rows) over lo..hi, ``size`` rows (a block) at a time."""
        hi = len(self) if hi is None else min(hi, len(self))
        size = size or READ
        for start in range(lo, hi, size):
            yield start, self.rows(start, min(start + size, hi))

    def row(self, i: int) -> np.void:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        if i >= self._written:
            return self._tail_rows(i - self._written, i - self._written + 1)[0]
        window = i // READ
        if self._cache is None or self._cache[0] != window:
            self._cache = (window, self._read(window * READ,
                                              min((window + 1) * READ, self._written)))
        return self._cache[1][i - window * READ]

    def _read(self, lo: int, hi: int) -> np.ndarray:
        assert self._file is not None
        rows = np.empty(hi - lo, dtype=ROW)
        self._file.seek(lo * ROW.itemsize)
        if self._file.readinto(rows.view(np.uint8)) != rows.nbytes:
            raise OSError(f"{self._file.name}: the report's temporary file came back short")
        return rows

    def _tail_rows(self, lo: int, hi: int) -> np.ndarray:
        rows = np.empty(hi - lo, dtype=ROW)
        for name, column in zip(FIELDS, self.tail):
            rows[name] = np.frombuffer(column, dtype=ROW[name])[lo:hi]
        return rows

    def column_min(self, name: str) -> float:
        return min(float(rows[name].min()) for _, rows in self.chunks())

    # -- order
    def sort(self) -> None:
        """Order by end time (the log is in that order unless clocks or writers disagree)."""
        last = -math.inf
        for _, rows in self.chunks():
            end = rows["end"]
            if end[0] < last or bool(np.any(end[1:] < end[:-1])):
                break
            last = float(end[-1])
        else:
            return
        rows = self.rows(0, len(self))
        rows = rows[np.argsort(rows["end"], kind="stable")]
        self._written, self._cache = 0, None
        for column in self.tail:
            del column[:]
        for name, column in zip(FIELDS, self.tail):
            column.frombytes(np.ascontiguousarray(rows[name]).tobytes())
        del rows
        while len(self.tail[0]) > BLOCK and self.spill_error is None:
            self._spill_first(BLOCK)

    def _spill_first(self, count: int) -> None:
        """Write the first ``count`` rows held in memory out (re-spilling a sorted log)."""
        keep = tuple(column[count:] for column in self.tail)
        for column in self.tail:
            del column[count:]
        self._spill()
        for column, rest in zip(self.tail, keep):
            column.extend(rest)

    def attempt_of(self, i: int) -> int:
        import bisect
        return bisect.bisect_right(self.attempt_starts, i) - 1

    def median_seconds(self) -> float | None:
        """The median of the steps' seconds (end - start), exactly as ``np.median``
        computes it, read a block at a time (``_kth``)."""
        n = len(self)
        if not n:
            return None
        key, below, upto = _kth(self, n // 2)
        value = _value(key)
        if n % 2:
            return value
        if below < n // 2:  # the (n/2 - 1)th is the same value
            return (value + value) / 2
        lower = max((int(less.max()) for keys in _keys(self)
                     if len(less := keys[keys < np.uint64(key)])), default=key)
        return (_value(lower) + value) / 2


class _Column:
    """One column of a StepLog, read like the array it used to be: ``[i]`` a number,
    ``[lo:hi]`` a numpy array (read from the file)."""

    def __init__(self, log: StepLog, name: str):
        self.log, self.name = log, name

    def __len__(self) -> int:
        return len(self.log)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            lo, hi, stride = i.indices(len(self.log))
            return self.log.rows(lo, hi)[self.name][::stride]
        return self.log.row(i)[self.name].item()


def _keys(log: StepLog) -> Iterator[np.ndarray]:
    """Each block's step seconds as unsigned integers in the same order as the floats."""
    for _, rows in log.chunks():
        seconds = rows["end"] - rows["start"]
        bits = seconds.view(np.uint64)
        yield np.where(bits >> np.uint64(63), ~bits, bits | np.uint64(1 << 63))


def _value(key: int) -> float:
    bits = key & ~(1 << 63) if key >> 63 else ~key & ((1 << 64) - 1)
    return float(np.array([bits], dtype=np.uint64).view(np.float64)[0])


def _kth(log: StepLog, k: int) -> tuple[int, int, int]:
    """(key of the k-th smallest step seconds, how many keys are smaller, how many are at
    most it): a radix selection, 16 bits a pass over the blocks, so no column is held."""
    prefix, below = 0, 0
    for shift in (48, 32, 16, 0):
        counts = np.zeros(1 << 16, dtype=np.int64)
        for keys in _keys(log):
            if shift < 48:
                keys = keys[(keys >> np.uint64(shift + 16)) == np.uint64(prefix)]
            counts += np.bincount(((keys >> np.uint64(shift)) & np.uint64(0xFFFF)).astype(np.int64),
                                  minlength=1 << 16)
        cumulative = np.cumsum(counts)
        digit = int(np.searchsorted(cumulative, k - below, side="right"))
        smaller = int(cumulative[digit - 1]) if digit else 0
        below += smaller
        prefix = (prefix << 16) | digit
        if shift == 0:
            return prefix, below, below + int(counts[digit])
    raise AssertionError("unreachable")


def step_numbers(log: StepLog, lo: int, hi: int) -> Iterator[int]:
    """The step numbers of rows lo..hi, a block at a time."""
    return itertools.chain.from_iterable(rows["step"].tolist()
                                         for _, rows in log.chunks(lo, hi))
