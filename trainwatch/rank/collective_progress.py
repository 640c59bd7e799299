"""Where this rank is in each process group's collectives, read on every heartbeat.

The agent names the rank the others wait for from what ranks publish: a rank's phase says
what its loop meant to do, not whether it is inside a collective (a user's ``metrics``
phase may all-reduce on a side group). torch keeps, per process group, the newest
collective enqueued and the newest completed (the flight recorder's ``pg_status``);
reading them costs ~15-25 µs, so the heartbeat thread puts them in the beat file each beat
(``collectives``, trainwatch/contract/collectives.py).

``pg_status`` names a group by a per-process counter, which differs between ranks when
groups leave some ranks out (a rank counts only the groups it is in); the group's name
(``new_group``'s, the same on every rank) is in the flight recorder's entries. Reading those
costs ~65 ms at 2,000 entries, so it is done only for a group not yet named and only while
the counters stand still (a stalled rank, or between collectives), not on every beat; a
group whose entries have left the ring is left out until it runs again. Groups appear
after their first collective; nothing is published without torch.distributed or with the
flight recorder off (``TORCH_FR_BUFFER_SIZE=0``), and a failed read costs the field, never
the rank.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any, Callable

from trainwatch.contract.collectives import beat_field

log = logging.getLogger(__name__)

Dump = Callable[[bool, bool, bool], bytes]
Key = tuple[int, str]  # (the dump it came from, the group's counter in this process)


def dumps() -> list[tuple[Dump, str]]:
    """torch's flight-recorder dumps and the suffix of their groups' names: the CPU one
    (gloo) and, in CUDA builds, NCCL's (a group with both backends counts apart in each)."""
    try:
        # torch's stub for this extension module omits the flight recorder's dumps.
        import torch._C._distributed_c10d as c10d
    except ImportError:
        return []
    return [(f, suffix) for name, suffix in (("_dump_fr_trace", ""), ("_dump_nccl_trace", ":nccl"))
            if callable(f := getattr(c10d, name, None))]


class CollectiveProgress:
    """Reads the process groups' collective counters; names them, orders them for the beat
    (groups the rank is inside a collective of, then the most recently active) and caps
    them."""

    def __init__(self, sources: list[tuple[Dump, str]] | None = None):
        self._sources = dict(enumerate(dumps() if sources is None else sources))
        self._names: dict[Key, str] = {}
        self._unnamed: dict[Key, int] = {}    # not found in the entries, at this count
        self._previous: dict[Key, tuple[int, int]] = {}
        self._moved: dict[str, int] = {}      # group name -> read number it last moved at
        self._enqueued: dict[str, int] = {}
        self._reads = 0

    def read(self) -> dict[str, list[int]] | None:
        """The beat's ``collectives``, or None (no named group has run a collective)."""
        if not self._sources:
            return None
        status = self._pg_status()
        unnamed = [k for k in status if k not in self._names
                   and self._unnamed.get(k) != status[k][0]]
        if unnamed and status == self._previous:
            self._learn_names(unnamed, status)
        self._previous = status
        self._reads += 1
        named: dict[str, tuple[int, int]] = {}
        for key in sorted(status, key=lambda k: (k[0], _number(k[1]))):
            if key in self._names:  # a later group of the same name (re-created) wins
                named[self._names[key] + self._sources[key[0]][1]] = status[key]
        for name, (enqueued, _) in named.items():
            if self._enqueued.get(name) != enqueued:
                self._enqueued[name], self._moved[name] = enqueued, self._reads
        order = sorted(named, key=lambda n: (named[n][0] <= named[n][1],
                                             -self._moved.get(n, 0), n))
        return beat_field({n: named[n] for n in order}) or None

    def _pg_status(self) -> dict[Key, tuple[int, int]]:
        status: dict[Key, tuple[int, int]] = {}
        for index, groups in self._each_dump(False).items():
            for uid, counters in (groups.get("pg_status") or {}).items():
                enqueued = counters.get("last_enqueued_collective") \
                    if isinstance(counters, dict) else None
                completed = counters.get("last_completed_collective") \
                    if isinstance(counters, dict) else None
                if isinstance(enqueued, int) and isinstance(completed, int):
                    status[(index, str(uid))] = (enqueued, completed)
        return status

    def _learn_names(self, unnamed: list[Key], status: dict[Key, tuple[int, int]]) -> None:
        """Name the groups in ``unnamed`` from the flight recorder's entries."""
        wanted = {index for index, _ in unnamed}
        for index, raw in self._each_dump(True, wanted).items():
            for entry in raw.get("entries") or []:
                group = entry.get("process_group") if isinstance(entry, dict) else None
                if isinstance(group, (tuple, list)) and group and "pg_id" in entry:
                    self._names[(index, str(entry["pg_id"]))] = str(group[0])
        for key in unnamed:
            if key not in self._names:
                self._unnamed[key] = status[key][0]

    def _each_dump(self, entries: bool, only: set[int] | None = None) -> dict[int, Any]:
        """Each source's unpickled dump (with its entries, without stacks); a source that
        fails is dropped for good, with a warning."""
        out = {}
        for index, (dump, _) in list(self._sources.items()):
            if only is not None and index not in only:
                continue
            try:
                raw = pickle.loads(dump(entries, False, False))
                if not isinstance(raw, dict):
                    raise TypeError(f"a {type(raw).__name__}, not a dict")
            except Exception as exc:  # never fail the rank's heartbeat
                del self._sources[index]
                log.warning("trainwatch: cannot read collective progress from %s (%r): the "
                            "agent may name a stall's culprit from phases only",
                            getattr(dump, "__name__", "torch"), exc)
                continue
            out[index] = raw
        return out


def _number(uid: str) -> int:
    return int(uid) if uid.isdigit() else -1
