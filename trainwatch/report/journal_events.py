"""The journal's events as the report holds them: routine ones as a few numbers each.

A run saves every few minutes for its whole length, and each save journals two events
(the save, the pruning of the oldest). Held as dicts they made the report's memory grow
with the run's length (~1.2 KiB a save); here each is a *shape* (its keys in order with
the values that repeat: names, rank, pid, flags), kept once per distinct combination, and
its numbers (time, step, seconds) in one float column. A routine event is made into a
dict again, with the same keys, order and types, each time it is read; every other event
is kept as the dict it was read as (so ``is`` and ``id`` hold for those).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any, Callable, Iterator

# Events that come for the run's whole length, and the only fields of them the report
# reads (not the paths and metrics).
ROUTINE_EVENTS = ("checkpoint_saved", "checkpoint_pruned", "checkpoint_skipped")
ROUTINE_FIELDS = ("v", "time", "event", "source", "host", "boot", "mono", "rank", "pid",
                  "step", "copy", "blocking_seconds", "write_seconds", "mode", "reason")
# Fields that change from one routine event to the next: kept as numbers, not in the shape.
_VARYING = frozenset(("time", "mono", "step", "blocking_seconds", "write_seconds"))
_EXACT = 1 << 53  # integers a float column holds exactly
_NONE = object()
_INT, _FLOAT = 1, 2  # kinds of a numeric slot


class Journal:
    """Storage for one journal's events: the dicts kept as read, and the routine ones as
    shapes and numbers. An event is referred to by an integer: ``i >= 0`` is ``dicts[i]``,
    ``i < 0`` is routine event ``~i``."""

    def __init__(self) -> None:
        self.dicts: list[dict[str, Any]] = []
        # per shape: keys, the repeating values (None at a slot), the slots (position,
        # kind), the position of ``time`` among the slots, and the event's name
        self._shapes: list[tuple[tuple[str, ...], list[Any], tuple[tuple[int, int], ...],
                                 int, str]] = []
        self._shape_ids: dict[tuple, int] = {}
        self._shape = array("q")    # per routine event: its shape
        self._offset = array("q")   # per routine event: its first number in _values
        self._values = array("d")

    def add(self, record: dict[str, Any]) -> int:
        """Keep ``record`` (its ``time`` a float); returns its reference."""
        if record["event"] in ROUTINE_EVENTS:
            ref = self._add_routine(record)
            if ref is not None:
                return ref
            record = {name: sys.intern(value) if type(value) is str else value
                      for name in ROUTINE_FIELDS if (value := record.get(name, _NONE)) is not _NONE}
        self.dicts.append(record)
        return len(self.dicts) - 1

    def _add_routine(self, record: dict[str, Any]) -> int | None:
        key: list[Any] = []
        numbers: list[float] = []
        for name in ROUTINE_FIELDS:
            value = record.get(name, _NONE)
            if value is _NONE:
                continue
            kind = type(value)
            if kind is float or (kind is int and name in _VARYING and -_EXACT <= value <= _EXACT):
                key.append((name, _FLOAT if kind is float else _INT))
                numbers.append(value)
            elif kind in (str, int, bool) or value is None:
                key.append((name, kind, sys.intern(value) if kind is str else value))
            else:
                return None  # a list or an object: kept as a dict
        shape_key = tuple(key)
        shape = self._shape_ids.get(shape_key)
        if shape is None:
            shape = self._shape_ids[shape_key] = len(self._shapes)
            names = tuple(part[0] for part in shape_key)
            values = [part[2] if len(part) == 3 else None for part in shape_key]
            slots = tuple((i, part[1]) for i, part in enumerate(shape_key) if len(part) == 2)
            time_slot = next(k for k, (i, _) in enumerate(slots) if names[i] == "time")
            self._shapes.append((names, values, slots, time_slot, record["event"]))
        self._shape.append(shape)
        self._offset.append(len(self._values))
        self._values.extend(numbers)
        return ~(len(self._shape) - 1)

    def __getitem__(self, ref: int) -> dict[str, Any]:
        if ref >= 0:
            return self.dicts[ref]
        j = ~ref
        names, values, slots, _, _ = self._shapes[self._shape[j]]
        at = self._offset[j]
        row = values.copy()
        numbers = self._values
        for k, (i, kind) in enumerate(slots):
            row[i] = numbers[at + k] if kind == _FLOAT else int(numbers[at + k])
        return dict(zip(names, row))

    def time(self, ref: int) -> float:
        """The event's ``time``, without making it into a dict."""
        if ref >= 0:
            return self.dicts[ref]["time"]
        j = ~ref
        return self._values[self._offset[j] + self._shapes[self._shape[j]][3]]

    def name(self, ref: int) -> str:
        """The event's name, without making it into a dict."""
        return self.dicts[ref]["event"] if ref >= 0 else self._shapes[self._shape[~ref]][4]

    def move(self, ref: int, seconds: float) -> None:
        """Add ``seconds`` to the event's ``time`` (report/clocks.py)."""
        if ref >= 0:
            self.dicts[ref]["time"] += seconds
        else:
            j = ~ref
            self._values[self._offset[j] + self._shapes[self._shape[j]][3]] += seconds


class Events(Sequence):
    """Some of a journal's events, in order, as a read-only sequence of dicts (routine
    ones made on each read: compare them by value, never by identity)."""

    def __init__(self, journal: Journal, refs: array | None = None):
        self.journal = journal
        self.refs = refs if refs is not None else array("q")

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Events(self.journal, self.refs[i])
        return self.journal[self.refs[i]]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        journal = self.journal
        return (journal[ref] for ref in self.refs)

    def each(self, names: tuple[str, ...]) -> Iterator[dict[str, Any]]:
        """The events called one of ``names``, in order (the others are not made)."""
        journal = self.journal
        return (journal[ref] for ref in self.refs if journal.name(ref) in names)

    def without(self, event: dict[str, Any]) -> Events:
        """These events but ``event`` (a kept dict, found by identity)."""
        journal = self.journal
        return Events(journal, array("q", (ref for ref in self.refs
                                           if ref < 0 or journal.dicts[ref] is not event)))

    def times(self, keep: Callable[[dict[str, Any]], bool] | None = None) -> array:
        """The events' times (of those ``keep`` accepts), as a float column."""
        journal = self.journal
        if keep is None:
            return array("d", (journal.time(ref) for ref in self.refs))
        return array("d", (journal.time(ref) for ref in self.refs if keep(journal[ref])))
