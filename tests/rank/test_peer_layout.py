"""Who keeps whose peer copy: a ring or cliques across nodes, never on the rank's own node,
and a one-node job told it has none (trainwatch/rank/memory_snapshots/peer_ring.py)."""

import pytest

from trainwatch.rank.memory_snapshots.peer_ring import (
    CLIQUE, NoPeerCopies, PeerLayout, PeerLayoutError, copies_per_rank, held_by, holders,
    nodes_from_blocks, nodes_from_names)


def test_the_ring_sends_a_copy_to_the_same_local_rank_on_the_next_node():
    node_of = nodes_from_blocks(world_size=6, local_world_size=2)   # 3 nodes of 2
    assert node_of == [0, 0, 1, 1, 2, 2]
    mapping = holders(PeerLayout(), node_of)
    assert mapping == {0: [2], 1: [3], 2: [4], 3: [5], 4: [0], 5: [1]}
    assert held_by(mapping, 0) == [4]
    assert copies_per_rank(PeerLayout(), node_of) == 1


def test_an_offset_skips_nodes_and_one_that_lands_home_is_refused():
    node_of = nodes_from_blocks(8, 2)                                 # 4 nodes
    assert holders(PeerLayout(offset=2), node_of)[0] == [4]
    with pytest.raises(NoPeerCopies, match="offset 4 with 4 nodes.*not a multiple of 4"):
        holders(PeerLayout(offset=4), node_of)


def test_nodes_come_from_the_names_ranks_report_in_order_of_their_lowest_rank():
    names = ["b", "a", "b", "a"]                # ranks interleaved over two machines
    node_of = nodes_from_names(names)
    assert node_of == [0, 1, 0, 1]
    mapping = holders(PeerLayout(), node_of)
    assert all(names[h] != names[r] for r, hs in mapping.items() for h in hs)
    assert mapping == {0: [1], 1: [0], 2: [3], 3: [2]}


def test_a_one_node_job_has_no_peer_copies_and_says_so():
    with pytest.raises(NoPeerCopies, match="one node: no peer copies.*durable checkpoint"):
        holders(PeerLayout(), nodes_from_blocks(4, 4))
    assert copies_per_rank(PeerLayout(), [0, 0]) == 0


def test_cliques_copy_to_every_other_node_of_the_clique_and_a_lone_node_joins_the_last():
    node_of = nodes_from_blocks(5, 1)                                 # 5 nodes of 1
    mapping = holders(PeerLayout(mode=CLIQUE, clique_size=2), node_of)
    assert mapping[0] == [1] and mapping[1] == [0]
    assert mapping[2] == [3, 4] and mapping[4] == [2, 3]           # {2, 3} + lone 4
    assert copies_per_rank(PeerLayout(mode=CLIQUE, clique_size=2), node_of) == 2


def test_uneven_nodes_still_keep_every_copy_off_its_node():
    node_of = nodes_from_names(["a", "a", "a", "b"])
    mapping = holders(PeerLayout(), node_of)
    assert mapping == {0: [3], 1: [3], 2: [3], 3: [0]}


@pytest.mark.parametrize("kwargs, words", [
    ({"mode": "star"}, "mode 'star'"), ({"offset": 0}, "offset 0"),
    ({"offset": 1.5}, "offset 1.5"), ({"clique_size": 1}, "clique_size 1"),
    ({"nodes": "racks"}, "nodes 'racks'")])
def test_a_bad_setting_names_itself(kwargs, words):
    with pytest.raises(PeerLayoutError, match=words):
        PeerLayout(**kwargs)
