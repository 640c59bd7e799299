"""One clock for a run whose processes' wall clocks disagree.

Every journal event carries its writer's wall clock (``time``) and monotonic clock
(``mono``, with the machine's ``boot``). On one machine and boot all processes share
the monotonic clock, so a writer's ``time - mono`` is its wall clock's offset: writers
that agree within ``CLOCKS_AGREE_SECONDS`` form the machine's clock, and a writer that
disagrees (a rank whose clock is 5 minutes behind) has its times moved onto it. Events
without ``mono`` (older run directories) and writers on other machines stay as written:
monotonic clocks of two machines cannot be compared.

The machine's own offset moves too: an NTP step of the wall clock, or a virtual machine
paused while its monotonic clock stood still (seen in CI: +28.8 s in one run), moves it
for every writer at once. So two writers are compared at the same moments (each event of
one against the other's events nearest in monotonic time), never as offsets over the
whole run: a rank that journaled mostly after such a step is not "another clock".
A writer agrees with another when its readings match the other's on one side or the
other of each of them (a step between them disagrees only on one side).
"""

from __future__ import annotations

import math
from array import array
from typing import Any, Iterable

import numpy as np

from trainwatch.contract.layout import rank_of_source
from trainwatch.node import CLOCKS_AGREE_SECONDS

# Whose clock a machine keeps when its writers split evenly: the controller's, the
# launcher's, then the lowest rank's.
_PREFERRED = ("engine", "launcher", "webhook")


def _writer(event: dict[str, Any]) -> tuple[str, str, str] | None:
    boot, host, source = event.get("boot"), event.get("host"), event.get("source")
    if not (isinstance(boot, str) and boot and isinstance(source, str)):
        return None
    return str(host), boot, source


def _rank_order(source: str) -> tuple[int, int]:
    if source in _PREFERRED:
        return 0, _PREFERRED.index(source)
    rank = rank_of_source(source)
    return (1, rank) if rank is not None else (2, 0)


class _Readings:
    """One writer's (monotonic time, wall offset) pairs, in the order written."""

    def __init__(self) -> None:
        self.mono, self.offset = array("d"), array("d")

    def columns(self) -> tuple[np.ndarray, np.ndarray]:
        """Both, sorted by monotonic time."""
        mono = np.frombuffer(self.mono, dtype=np.float64)
        order = np.argsort(mono, kind="stable")
        return mono[order], np.frombuffer(self.offset, dtype=np.float64)[order]


def _compare(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]
             ) -> tuple[float, float]:
    """How far writer ``a``'s wall clock reads ahead of ``b``'s, each reading of ``a``
    against ``b``'s readings on either side of it in monotonic time: (the median of the
    smaller of the two differences, which is ~0 for a writer on the same clock even where
    the machine's clock stepped between them; the median against the nearer one, the
    best estimate of a real disagreement)."""
    a_mono, a_offset = a
    b_mono, b_offset = b
    right = np.clip(np.searchsorted(b_mono, a_mono), 0, len(b_mono) - 1)
    left = np.clip(right - 1, 0, len(b_mono) - 1)
    to_left, to_right = a_offset - b_offset[left], a_offset - b_offset[right]
    smaller = np.where(np.abs(to_left) <= np.abs(to_right), to_left, to_right)
    nearer = np.where(np.abs(b_mono[left] - a_mono) <= np.abs(b_mono[right] - a_mono),
                      to_left, to_right)
    return float(np.median(smaller)), float(np.median(nearer))


def _machine_shifts(writers: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, float]:
    """{source: seconds to add} for the writers of one machine whose clock disagrees with
    the clock most of them agree on (ties: the preferred writer's)."""
    clusters: list[list[str]] = []  # the first of each is its representative
    for source in sorted(writers, key=_rank_order):
        home = next((c for c in clusters if abs(_compare(
            writers[source], writers[c[0]])[0]) <= CLOCKS_AGREE_SECONDS), None)
        if home is None:
            clusters.append([source])
        else:
            home.append(source)
    best = min(clusters, key=lambda c: (-len(c), min(map(_rank_order, c))))
    return {source: -_compare(writers[source], writers[best[0]])[1]
            for cluster in clusters if cluster is not best for source in cluster}


def clock_shifts(events: Iterable[dict[str, Any]]) -> dict[tuple[str, str, str], float]:
    """Seconds to add to the times of each writer (host, boot, source) whose wall clock
    disagrees with its machine's; {} when every writer agrees."""
    per_writer: dict[tuple[str, str, str], _Readings] = {}
    for e in events:
        writer, mono = _writer(e), e.get("mono")
        if writer is not None and isinstance(mono, (int, float)) and not isinstance(
                mono, bool) and math.isfinite(mono):
            readings = per_writer.setdefault(writer, _Readings())
            readings.mono.append(mono)
            readings.offset.append(e["time"] - mono)
    machines: dict[tuple[str, str], dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    for (host, boot, source), readings in per_writer.items():
        machines.setdefault((host, boot), {})[source] = readings.columns()
    shift: dict[tuple[str, str, str], float] = {}
    for (host, boot), writers in machines.items():
        for source, seconds in _machine_shifts(writers).items():
            shift[(host, boot, source)] = seconds
    return shift


def writer_shift(event: dict[str, Any], shift: dict[tuple[str, str, str], float]
                 ) -> float | None:
    """The seconds ``clock_shifts`` adds to this event's time, or None."""
    writer = _writer(event)
    return shift.get(writer) if writer is not None else None


def by_source(shift: dict[tuple[str, str, str], float]) -> dict[str, float]:
    """The seconds added per source (``rank1``: +300.0), for records of the same process
    outside the journal (rank 0's metrics log)."""
    moved: dict[str, float] = {}
    for (_, _, source), seconds in shift.items():
        moved.setdefault(source, seconds)
    return moved


def align(events: list[dict[str, Any]]) -> dict[str, float]:
    """Move the times of writers whose wall clock disagrees with their machine's (in place).

    Returns the seconds added per source (``rank1``: +300.0), for the writers that were
    moved, so records of the same process outside the journal (rank 0's metrics log) can
    be moved alike.
    """
    shift = clock_shifts(events)
    if not shift:
        return {}
    for e in events:
        seconds = writer_shift(e, shift)
        if seconds is not None:
            e["time"] += seconds
    return by_source(shift)
