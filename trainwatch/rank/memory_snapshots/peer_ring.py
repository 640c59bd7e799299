"""Who keeps a copy of whose snapshot: a ring (or cliques) across nodes, never the same node.

A snapshot in /dev/shm outlives its process but not its node; a copy on another node's
rank is what a node loss leaves (docs/memory-snapshots.md, "Peer copies"). Pure functions:

* ``nodes_from_names(names)``: the node of each rank from the node names the ranks report
  (``trainwatch.node.node_name``, the default), nodes numbered in order of their lowest rank;
  ``nodes_from_blocks(world_size, local_world_size)``: torchrun's assignment, node = a
  ``LOCAL_WORLD_SIZE``-sized block of ranks.
* ``holders(layout, node_of)``: rank -> the ranks that keep its copies. ``ring`` (default):
  the rank with the same local index on the node ``offset`` nodes on; ``clique``: that
  rank on every other node of its clique of ``clique_size`` nodes. Raises
  ``NoPeerCopies`` (with the reason to show) for a one-node job, or a layout that would put
  a copy on its own node.
* ``held_by(holders_map, rank)``: the ranks whose copies ``rank`` keeps.

Memory a rank holds for others: ``copies_per_rank(layout, nodes)`` snapshots of a rank's
size, two copies each (docs/memory-snapshots.md).
"""

from __future__ import annotations

from dataclasses import dataclass

RING = "ring"
CLIQUE = "clique"
BY_NAMES = "names"
BY_BLOCKS = "blocks"


class PeerLayoutError(ValueError):
    """A layout setting that cannot work: the message names the setting and a value that would."""


class NoPeerCopies(Exception):
    """This job cannot keep copies on another node; ``str()`` says why, for the status."""


@dataclass(frozen=True)
class PeerLayout:
    """How copies are spread: ``mode`` ring or clique, ``offset`` (ring: copies go that many
    nodes on), ``clique_size`` (clique: nodes that keep each other's copies), ``nodes``:
    which ranks share a node, by the names they report or by torchrun's blocks."""

    mode: str = RING
    offset: int = 1
    clique_size: int = 2
    nodes: str = BY_NAMES

    def __post_init__(self) -> None:
        if self.mode not in (RING, CLIQUE):
            raise PeerLayoutError(f"peer copies: mode {self.mode!r} is not one of "
                                  f"{RING!r}, {CLIQUE!r}")
        if self.nodes not in (BY_NAMES, BY_BLOCKS):
            raise PeerLayoutError(f"peer copies: nodes {self.nodes!r} is not one of "
                                  f"{BY_NAMES!r}, {BY_BLOCKS!r}")
        if type(self.offset) is not int or self.offset < 1:
            raise PeerLayoutError(f"peer copies: offset {self.offset!r} must be a whole "
                                  "number of nodes >= 1 (1: the next node)")
        if type(self.clique_size) is not int or self.clique_size < 2:
            raise PeerLayoutError(f"peer copies: clique_size {self.clique_size!r} must be "
                                  "a whole number of nodes >= 2")


def nodes_from_names(names: list[str]) -> list[int]:
    """Each rank's node index; nodes numbered in the order of their lowest rank."""
    index: dict[str, int] = {}
    return [index.setdefault(name, len(index)) for name in names]


def nodes_from_blocks(world_size: int, local_world_size: int) -> list[int]:
    """Each rank's node as torchrun assigns ranks: blocks of ``local_world_size``."""
    if local_world_size < 1:
        raise PeerLayoutError(f"peer copies: LOCAL_WORLD_SIZE {local_world_size} must be >= 1")
    return [rank // local_world_size for rank in range(world_size)]


def _members(node_of: list[int]) -> list[list[int]]:
    """The ranks of each node (by node index), in rank order."""
    members: list[list[int]] = [[] for _ in range(max(node_of, default=-1) + 1)]
    for rank, node in enumerate(node_of):
        members[node].append(rank)
    return [m for m in members if m]


def _cliques(count: int, size: int) -> list[list[int]]:
    """Consecutive node indices in groups of ``size``; a last group of one joins the one
    before (a node alone would have no peer)."""
    groups = [list(range(start, min(start + size, count))) for start in range(0, count, size)]
    if len(groups) > 1 and len(groups[-1]) == 1:
        lone = groups.pop()
        groups[-1] += lone
    return groups


def holders(layout: PeerLayout, node_of: list[int]) -> dict[int, list[int]]:
    """Rank -> the ranks that keep its copy (each on another node than the rank's)."""
    members = _members(node_of)
    count = len(members)
    if count < 2:
        raise NoPeerCopies("one node: no peer copies (every rank is on the same node, so a "
                           "node loss falls back to the durable checkpoint)")
    node_index = {tuple(m): n for n, m in enumerate(members)}
    local = {rank: (node_index[tuple(m)], i) for m in members for i, rank in enumerate(m)}
    result: dict[int, list[int]] = {}
    if layout.mode == RING:
        if layout.offset % count == 0:
            raise NoPeerCopies(f"ring offset {layout.offset} with {count} nodes puts every "
                               f"copy on its own node: choose an offset that is not a "
                               f"multiple of {count}")
        for rank, (node, i) in local.items():
            target = members[(node + layout.offset) % count]
            result[rank] = [target[i % len(target)]]
    else:
        for clique in _cliques(count, layout.clique_size):
            for node in clique:
                for i, rank in enumerate(members[node]):
                    result[rank] = [members[other][i % len(members[other])]
                                    for other in clique if other != node]
    check_other_node(result, node_of)
    return dict(sorted(result.items()))


def check_other_node(holders_map: dict[int, list[int]], node_of: list[int]) -> None:
    """Refuse (NoPeerCopies) a map that keeps any copy on its rank's own node."""
    same = [(rank, h) for rank, hs in holders_map.items() for h in hs
            if node_of[h] == node_of[rank]]
    if same:
        rank, holder = same[0]
        raise NoPeerCopies(f"rank {rank}'s copy would be kept by rank {holder} on the same "
                           "node, which a node loss takes too")


def held_by(holders_map: dict[int, list[int]], rank: int) -> list[int]:
    """The ranks whose copies ``rank`` keeps."""
    return sorted(r for r, hs in holders_map.items() if rank in hs)


def copies_per_rank(layout: PeerLayout, node_of: list[int]) -> int:
    """The most snapshots of other ranks any one rank keeps (each as up to 2 copies)."""
    try:
        mapping = holders(layout, node_of)
    except NoPeerCopies:
        return 0
    return max((len(held_by(mapping, r)) for r in mapping), default=0)
