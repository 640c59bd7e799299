"""The newest step every rank of the new world has, and who sends what: pure functions of
the gathered inventory (trainwatch/rank/memory_snapshots/peer_fetch.py)."""

from trainwatch.rank.memory_snapshots.peer_fetch import Entry, choose_step, plan, wanted_rank


def own(rank, step, world=4, holder=None, digest=None):
    return Entry(rank if holder is None else holder, rank, step, world,
                 digest or f"d{rank}-{step}", f"/shm/own/{rank}/{step}", True)


def held(rank, step, holder, world=4, digest=None):
    return Entry(holder, rank, step, world, digest or f"d{rank}-{step}",
                 f"/shm/held/{rank}/{step}", False)


def ring_of_two_nodes(step):
    """4 ranks on 2 nodes, each with its own snapshot and its ring partner's copy."""
    partner = {0: 2, 1: 3, 2: 0, 3: 1}
    return [own(r, step) for r in range(4)] + [held(r, step, partner[r]) for r in range(4)]


def test_the_newest_step_every_rank_has_wins_over_a_newer_one_some_lack():
    entries = ring_of_two_nodes(11) + [own(0, 12), own(1, 12), own(2, 12)]
    choice, why = choose_step(entries, new_world=4)
    assert why == "" and choice is not None
    assert (choice.step, choice.world_size) == (11, 4)
    assert choice.digests == {r: f"d{r}-11" for r in range(4)}


def test_a_lost_node_is_covered_by_the_copies_the_other_node_holds():
    # node 1 (ranks 2, 3) came back empty: only node 0's own snapshots and held copies
    entries = [own(0, 11), own(1, 11), held(2, 11, holder=0), held(3, 11, holder=1)]
    choice, _ = choose_step(entries, new_world=4)
    assert choice is not None and choice.step == 11
    local, transfers = plan(choice, entries, 4, node_of=[0, 0, 1, 1])
    assert set(local) == {0, 1}
    assert [(t.source, t.to_rank, t.entry.rank) for t in transfers] == [(0, 2, 2), (1, 3, 3)]


def test_a_corrupt_or_missing_copy_is_not_counted_and_the_reason_names_the_gap():
    # rank 3's own snapshot is gone and its copy did not verify (left out of the inventory)
    entries = [own(0, 11), own(1, 11), own(2, 11), own(0, 10), own(1, 10), own(2, 10),
               held(3, 10, holder=1)]
    choice, _ = choose_step(entries, new_world=4)
    assert choice is not None and choice.step == 10
    nothing, why = choose_step([own(0, 11), own(1, 11)], new_world=4)
    assert nothing is None and why == "step 11 (the newest) has no verified copy of rank(s) 2, 3"
    assert choose_step([], 2) == (None, "no verified snapshot on any rank")


def test_copies_that_disagree_take_the_owners_digest():
    entries = [own(0, 5, world=2), own(1, 5, world=2, digest="mine"),
               held(1, 5, holder=0, world=2, digest="stale")]
    choice, _ = choose_step(entries, new_world=2)
    assert choice is not None and choice.digests[1] == "mine"
    local, transfers = plan(choice, entries, 2, node_of=[0, 1])
    assert local[1].digest == "mine" and not transfers


def test_a_shrunk_world_needs_only_its_own_ranks_snapshots():
    # 4 ranks on 2 nodes; node 0 lost; the job goes on with 2 ranks on the old node 1,
    # renumbered 0 and 1: they hold ranks 0 and 1's copies, and old ranks 2, 3's own
    # snapshots are not needed (data position and RNGs: the world-size rules)
    entries = [held(0, 11, holder=0), held(1, 11, holder=1),
               own(2, 11, holder=0), own(3, 11, holder=1)]
    choice, _ = choose_step(entries, new_world=2)
    assert choice is not None and (choice.step, choice.world_size) == (11, 4)
    assert set(choice.digests) == {0, 1}
    local, transfers = plan(choice, entries, 2, node_of=[0, 0])
    assert {r: (e.rank, e.own) for r, e in local.items()} == {0: (0, False), 1: (1, False)}
    assert transfers == []


def test_a_grown_world_gives_new_ranks_rank_0s_replica():
    entries = [own(0, 7, world=2), own(1, 7, world=2)]
    choice, _ = choose_step(entries, new_world=4)
    assert choice is not None and set(choice.digests) == {0, 1}
    assert [wanted_rank(r, 2) for r in range(4)] == [0, 1, 0, 0]
    local, transfers = plan(choice, entries, 4, node_of=[0, 1, 2, 2])
    assert set(local) == {0, 1}
    assert sorted((t.to_rank, t.entry.rank) for t in transfers) == [(2, 0), (3, 0)]


def test_sharded_state_resumes_from_memory_only_at_the_world_size_that_wrote_it():
    entries = [own(r, 9) for r in range(4)]
    choice, why = choose_step(entries, new_world=2, replicated=False)
    assert choice is None and "sharded state of 4 ranks cannot resume on 2" in why
    choice, _ = choose_step(entries, new_world=4, replicated=False)
    assert choice is not None and choice.step == 9


def test_transfers_are_spread_over_the_holders():
    # a clique kept ranks 4 and 5's copies on both other nodes
    entries = [own(r, 3, world=6) for r in range(4)] + [
        held(4, 3, holder=0, world=6), held(4, 3, holder=2, world=6),
        held(5, 3, holder=1, world=6), held(5, 3, holder=3, world=6)]
    choice, _ = choose_step(entries, new_world=6)
    assert choice is not None
    _, transfers = plan(choice, entries, 6, node_of=[0, 0, 1, 1, 2, 2])
    assert sorted(t.source for t in transfers) == [0, 1]
