"""One clock for a run whose processes' wall clocks disagree.

Every journal event carries its writer's wall clock (``time``) and monotonic clock
(``mono``, with the machine's ``boot``). On one machine and boot all processes share
the monotonic clock, so a writer's ``time - mono`` is its wall clock's offset: writers
that agree within ``CLOCKS_AGREE_SECONDS`` form the machine's clock, and a writer that
disagrees (a rank whose clock is 5 minutes behind) has its times moved onto it. Events
without ``mono`` (older run directories) and writers on other machines stay as written:
monotonic clocks of two machines cannot be compared.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Iterable

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


def _machine_offset(offsets: dict[str, float]) -> float:
    """The offset most writers of one machine agree on (ties: the preferred writer's)."""
    clusters: list[list[str]] = []
    for source in sorted(offsets, key=offsets.__getitem__):
        if clusters and offsets[source] - offsets[clusters[-1][0]] <= CLOCKS_AGREE_SECONDS:
            clusters[-1].append(source)
        else:
            clusters.append([source])
    best = min(clusters, key=lambda c: (-len(c), min(map(_rank_order, c))))
    return statistics.median(offsets[s] for s in best)


def clock_shifts(events: Iterable[dict[str, Any]]) -> dict[tuple[str, str, str], float]:
    """Seconds to add to the times of each writer (host, boot, source) whose wall clock
    disagrees with its machine's; {} when every writer agrees."""
    per_writer: dict[tuple[str, str, str], list[float]] = {}
    for e in events:
        writer, mono = _writer(e), e.get("mono")
        if writer is not None and isinstance(mono, (int, float)) and not isinstance(
                mono, bool) and math.isfinite(mono):
            per_writer.setdefault(writer, []).append(e["time"] - mono)
    machines: dict[tuple[str, str], dict[str, float]] = {}
    for (host, boot, source), offsets in per_writer.items():
        machines.setdefault((host, boot), {})[source] = statistics.median(offsets)
    shift: dict[tuple[str, str, str], float] = {}
    for (host, boot), writers in machines.items():
        reference = _machine_offset(writers)
        for source, offset in writers.items():
            if abs(reference - offset) > CLOCKS_AGREE_SECONDS:
                shift[(host, boot, source)] = reference - offset
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
