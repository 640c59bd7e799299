"""The labelled intervals of the time line other than steps, held as columns.

A run evaluates and saves for its whole length: one interval each, and each marks the
step it follows as ending later (``AfterSteps``). As objects and dict entries these made
the report's memory grow ~300 bytes an evaluation or save; as columns they are ~40.
"""

from __future__ import annotations

from array import array

import numpy as np


class Pieces:
    """Intervals as columns: start, end, label and tier (small integers), and the
    incident each is charged to (-1: none), in the order they were painted."""

    def __init__(self) -> None:
        self.start, self.end = array("d"), array("d")
        self.label, self.tier, self.incident = array("q"), array("q"), array("q")

    def __len__(self) -> int:
        return len(self.start)

    def append(self, start: float, end: float, label: int, tier: int, incident: int) -> None:
        self.start.append(start)
        self.end.append(end)
        self.label.append(label)
        self.tier.append(tier)
        self.incident.append(incident)

    def marks(self) -> tuple[np.ndarray, np.ndarray]:
        """Every piece's start and end in the order of (time, opening, piece) sorted, ends
        before starts: the order of positions in [ends..., starts...] stably sorted by
        time. Returns the times in that order and the positions (a start of piece ``i``
        is ``n + i``, its end ``i``), 16 bytes a mark."""
        times = np.concatenate([np.frombuffer(self.end, dtype=np.float64),
                                np.frombuffer(self.start, dtype=np.float64)])
        order = np.argsort(times, kind="stable")
        return times[order], order


class AfterSteps:
    """Step index -> when the evaluation or save that followed that step ended: sorted
    columns, filled an attempt at a time (``add``: a later value for an index wins)."""

    def __init__(self) -> None:
        self._index: list[np.ndarray] = []
        self._value: list[np.ndarray] = []
        self.index = np.empty(0, dtype=np.int64)
        self.value = np.empty(0, dtype=np.float64)

    def add(self, index: np.ndarray, value: np.ndarray) -> None:
        self._index.append(index)
        self._value.append(value)

    def freeze(self) -> None:
        """Make the columns from what was added (the last value of an index wins)."""
        if not self._index:
            return
        index = np.concatenate(self._index)[::-1]
        value = np.concatenate(self._value)[::-1]
        self.index, first = np.unique(index, return_index=True)
        self.value = value[first]
        self._index, self._value = [], []

    def get(self, i: int, default: float) -> float:
        k = int(np.searchsorted(self.index, i))
        return float(self.value[k]) if k < len(self.index) and self.index[k] == i else default


def last_of_each(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct keys, sorted, each with the value of its last occurrence."""
    keys, first = np.unique(keys[::-1], return_index=True)
    return keys, values[::-1][first]


def look_up(keys: np.ndarray, values: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Per wanted key, its value in ``keys`` (sorted, distinct), else -1."""
    at = np.searchsorted(keys, wanted)
    found = at < len(keys)
    found[found] = keys[at[found]] == wanted[found]
    out = np.full(len(wanted), -1, dtype=np.int64)
    out[found] = values[at[found]]
    return out
