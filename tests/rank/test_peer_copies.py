"""``PeerCopies.start`` with ranks as threads over an in-process collective: every receiver
knows what it holds before any rank can send, and a one-node job says it has no copies."""

import threading

import pytest

from trainwatch.contract.ports import LOOPBACK
from trainwatch.rank.memory_snapshots.peer_copies import PeerCopies, PeerSettings
from trainwatch.rank.memory_snapshots.peer_receiver import PeerReceiver
from trainwatch.rank.memory_snapshots.peer_ring import BY_BLOCKS, PeerLayout


class ThreadCollective:
    """all_gather / broadcast between threads of one process."""

    def __init__(self, rank, shared):
        self.rank, self.world_size, self._shared = rank, len(shared["slots"]), shared

    def all_gather(self, obj):
        self._shared["slots"][self.rank] = obj
        self._shared["barrier"].wait(30)
        out = list(self._shared["slots"])
        self._shared["barrier"].wait(30)
        return out

    def broadcast(self, obj):
        return self.all_gather(obj)[0]


def start_ranks(tmp_path, world, settings):
    shared = {"slots": [None] * world, "barrier": threading.Barrier(world)}
    started, errors = [None] * world, []

    def run(rank):
        try:
            started[rank] = PeerCopies.start(tmp_path / f"node{rank}", settings,
                                             ThreadCollective(rank, shared), host=LOOPBACK)
        except Exception as exc:  # shown by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    return threads, started, errors


def test_no_rank_starts_sending_before_every_receiver_knows_what_it_holds(
        tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")                      # 2 nodes of 1 rank
    settings = PeerSettings(layout=PeerLayout(nodes=BY_BLOCKS))
    order, rank0_started = [], threading.Event()
    hold = PeerReceiver.hold

    def slow_hold(self, ranks):                  # rank 1 is slow to learn what it holds
        if self.rank == 1:
            rank0_started.wait(1.0)              # as long as rank 0 is still in start()
            order.append("rank 1 holds")
        hold(self, ranks)

    monkeypatch.setattr(PeerReceiver, "hold", slow_hold)
    threads, started, errors = start_ranks(tmp_path, 2, settings)
    threads[1].start()
    threads[0].start()
    threads[0].join(30)
    order.append("rank 0 can send")
    rank0_started.set()
    threads[1].join(30)
    try:
        assert errors == []
        assert order == ["rank 1 holds", "rank 0 can send"]
        assert started[0].holders == {0: [1], 1: [0]} and started[0].off_reason == ""
        assert "secret" not in repr(started[0]).lower()
    finally:
        for copies in started:
            if copies is not None:
                copies.close()


def test_a_one_node_job_starts_without_copies_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWATCH_NODE", "only-node")
    threads, started, errors = start_ranks(tmp_path, 2, PeerSettings())
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert errors == []
        stats = started[1].stats()
        assert stats["holders"] == [] and stats["holding"] == []
        assert stats["off_reason"].startswith("one node: no peer copies")
    finally:
        for copies in started:
            copies.close()


@pytest.mark.parametrize("env, expected", [
    ({"TRAINWATCH_PEER_ADDR": "10.1.2.3"}, "10.1.2.3"),
    ({"MASTER_ADDR": "localhost"}, LOOPBACK)])
def test_the_receiver_listens_where_the_job_says(env, expected):
    from trainwatch.rank.memory_snapshots.peer_copies import peer_host

    assert peer_host(env) == expected
