"""A multi-node job's lost nodes, as its leader sees them in the shared run directory.

torchrun decides what a lost node costs the job (docs/deploy.md, "A lost node"): with
``--nnodes MIN:MAX`` the other nodes re-rendezvous without it and resume from the newest
checkpoint at the smaller world size; with a fixed ``--nnodes`` they wait for it up to
the rendezvous timeout. Either way the journal must say which node went, once, and when
it came back, so the summary, ``report`` and ``diagnose`` name it instead of the ranks
that failed after it.

The leader (node rank 0) calls a node lost when two things that do not share a failure
both stopped: the node's supervisor heartbeat (``supervisors/<node>.beat``) and every
heartbeat of that node's ranks. A dead supervisor alone is the node agent's to page
(TrainwatchSupervisorDown); ranks alone stopping is a stall or a crash, the engine's.
Silence is observed on the leader's own monotonic clock (a record that stops changing),
never from the other node's wall-clock times, which may be skewed.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from trainwatch.contract.layout import NODE_BEAT_SUFFIX
from trainwatch.control.job_nodes import JobNodes
from trainwatch.rundir.beat import beat_path, read_beat
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.supervisor_beat import read_supervisor_beat

log = logging.getLogger(__name__)

LOST_AFTER_SECONDS = 15.0  # supervisor and ranks silent this long: the node is lost
LOOK_EVERY_SECONDS = 1.0   # the heartbeats are read at most this often
QUIET_SECONDS = 2.0        # a supervisor beat unchanged this long: its ranks are read too


@dataclass
class _Seen:
    beat: Any                        # the node's supervisor heartbeat, as last read
    beat_changed_at: float           # on the leader's monotonic clock
    ranks: Any = None                # its ranks' heartbeats: read only while it is silent
    ranks_changed_at: float | None = None
    lost_at: float | None = None


class NodeWatch:
    """Journals ``node_lost`` once when another node falls silent, ``node_returned`` when
    its supervisor beats again. ``check()`` is one look; the leader calls it every poll.
    A look reads one heartbeat per node; the statuses and rank heartbeats only of a node
    whose supervisor stopped beating (``QUIET_SECONDS``), so a large healthy job costs the
    leader a file per node a second, not one per rank."""

    def __init__(self, run: RunDir, nodes: JobNodes, journal: Callable[..., None],
                 lost_after: float = LOST_AFTER_SECONDS,
                 clock: Callable[[], float] = time.monotonic):
        self.run, self.nodes, self.journal = run, nodes, journal
        self.lost_after, self.clock = lost_after, clock
        self.seen: dict[str, _Seen] = {}
        self._looked: float | None = None

    def check(self) -> None:
        now = self.clock()
        if self._looked is not None and now - self._looked < LOOK_EVERY_SECONDS:
            return
        self._looked = now
        ranks: dict[str, list[int]] | None = None  # read once a look, when needed
        for node in self._other_nodes():
            beat = _beat_key(read_supervisor_beat(self.run, node))
            seen = self.seen.get(node)
            if seen is None:
                self.seen[node] = _Seen(beat, now)
                continue
            if beat != seen.beat:
                seen.beat, seen.beat_changed_at, seen.ranks = beat, now, None
                if seen.lost_at is not None:
                    self.journal("node_returned", **self.nodes.journal(), lost_node=node,
                                 lost_seconds=round(now - seen.lost_at, 1))
                    log.warning("node %s is back: the job grows back at its next restart "
                                "(torchrun --nnodes MIN:MAX)", node)
                    seen.lost_at = None
                continue
            if now - seen.beat_changed_at < QUIET_SECONDS:
                continue  # beating
            ranks = self._ranks_by_node() if ranks is None else ranks
            own = ranks.get(node, [])
            rank_beats = tuple(self._rank_beat(r) for r in own)
            if rank_beats != seen.ranks:  # None: not read since the supervisor went quiet
                seen.ranks, seen.ranks_changed_at = rank_beats, now
                continue
            assert seen.ranks_changed_at is not None
            silent = now - max(seen.beat_changed_at, seen.ranks_changed_at)
            if seen.lost_at is None and silent >= self.lost_after:
                seen.lost_at = now
                # Since its supervisor's last beat: when the node went (report places it).
                gone = now - seen.beat_changed_at
                self.journal("node_lost", **self.nodes.journal(), lost_node=node,
                             ranks=own, silent_seconds=round(gone, 1))
                log.warning("node %s lost: its supervisor and its ranks %s silent for %.0f s",
                            node, own, gone)

    def _other_nodes(self) -> list[str]:
        """Nodes whose supervisor ever beat in this run directory, but this one."""
        folder = self.run.node_supervisor_beat_file(self.nodes.node).parent
        try:
            names = sorted(e.name[:-len(NODE_BEAT_SUFFIX)] for e in os.scandir(folder)
                           if e.name.endswith(NODE_BEAT_SUFFIX))
        except OSError:
            return []
        return [n for n in names if n != _file_name(self.run, self.nodes.node)]

    def _ranks_by_node(self) -> dict[str, list[int]]:
        """The ranks each node's statuses name (a node's newest generation and older ones
        alike: a lost node's ranks keep their last status)."""
        found: dict[str, set[int]] = {}
        for status in self.run.statuses().records:
            node, rank = status.get("node"), status.get("rank")
            if isinstance(node, str) and isinstance(rank, int) and not isinstance(rank, bool):
                found.setdefault(_file_name(self.run, node), set()).add(rank)
        return {n: sorted(r) for n, r in found.items()}

    def _rank_beat(self, rank: int) -> Any:
        record = read_beat(beat_path(self.run.status_dir, rank), self.run.root)
        return None if record is None else (record.get("pid"), record.get("heartbeat_mono"))


def _beat_key(record: dict[str, Any] | None) -> Any:
    return None if record is None else (record.get("token"), record.get("at"))


def _file_name(run: RunDir, node: str) -> str:
    """The name a node's supervisor files carry (``file_safe``)."""
    return run.node_supervisor_beat_file(node).name[:-len(NODE_BEAT_SUFFIX)]
