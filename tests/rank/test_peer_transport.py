"""Peer copies on the wire and on disk, with a real receiver and sender on loopback: copies
verified and bounded, strangers and torn transfers kept out, a full tmpfs skipped and
counted, a dead peer costing a timeout, never the loop (trainwatch/rank/memory_snapshots/)."""

import json
import os
import socket
import stat
import struct
import time

import pytest

from conftest import tmpfs_mount
from trainwatch.contract.ports import LOOPBACK
from trainwatch.rank.memory_snapshots import peer_wire as wire
from trainwatch.rank.memory_snapshots.peer_receiver import PeerReceiver
from trainwatch.rank.memory_snapshots.peer_sender import PeerSender
from trainwatch.rank.memory_snapshots.peer_store import PeerStore, SnapshotFile

SECRET = b"s" * 32


@pytest.fixture
def receiver(tmp_path):
    """Rank 0's receiver, holding rank 2's copies."""
    rx = PeerReceiver(LOOPBACK, SECRET, 0, PeerStore(tmp_path / "held"),
                      PeerStore(tmp_path / "fetched"), timeout=2.0).start()
    rx.hold({2})
    yield rx
    rx.close()


def snapshot(tmp_path, step, rank=2, size=3 << 20):
    path = tmp_path / f"own-{rank}-{step}.bin"
    path.write_bytes(bytes([step % 251]) * size)
    return SnapshotFile(rank, step, 4, f"digest-{step}", path)


def wait_counts(rx, key, n=1):
    deadline = time.monotonic() + 20
    while rx.stats().get(key, 0) < n:
        assert time.monotonic() < deadline, f"receiver counts {rx.stats()}, waiting for {key}"
        time.sleep(0.02)


def endpoint(rx):
    return wire.Endpoint(0, LOOPBACK, rx.port)


def test_copies_arrive_verified_private_and_at_most_two_per_rank(receiver, tmp_path):
    sender = PeerSender(2, [endpoint(receiver)], SECRET, timeout=2.0).start()
    try:
        for step in (1, 2, 3):
            sender.offer(snapshot(tmp_path, step))
            assert sender.wait_sent(step, 20)
    finally:
        sender.close()
    store = receiver.held
    copies = store.copies(2)
    assert [c.snapshot.step for c in copies] == [3, 2]           # the newest 2
    assert all(store.verify(c) == "" for c in copies)
    assert copies[0].snapshot.path.read_bytes() == snapshot(tmp_path, 3).path.read_bytes()
    assert copies[0].snapshot.digest == "digest-3" and copies[0].from_rank == 2
    assert stat.S_IMODE(os.stat(store.rank_dir(2)).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.base).st_mode) == 0o700
    assert {stat.S_IMODE(os.stat(p).st_mode) for p in store.rank_dir(2).iterdir()} == {0o600}
    assert len(list(store.rank_dir(2).iterdir())) == 4           # 2 files + 2 records
    assert sender.stats()["holders"][0]["stored_step"] == 3
    assert "s" * 32 not in repr(sender) + repr(receiver)


def test_each_steps_part_reaches_the_peer_apart_and_a_slow_link_drops_and_counts(
        receiver, tmp_path):
    """A rank's per-step part (rank_parts.py) goes to its holder's parts store, the newest
    2 kept, beside its snapshots, not among them. Offers a busy link could not send are
    replaced by the newest and counted ``dropped``; ``offer`` never waits."""
    parts = PeerSender(2, [endpoint(receiver)], SECRET, timeout=2.0, kind=wire.PART).start()
    try:
        for step in (4, 5, 6):
            parts.offer(snapshot(tmp_path, step, size=4096))
            assert parts.wait_sent(step, 20)
    finally:
        parts.close()
    wait_counts(receiver, "part_stored", 3)  # counted just after the sender's answer
    assert [c.snapshot.step for c in receiver.parts.copies(2)] == [6, 5]
    assert receiver.held.copies(2) == []
    assert all(receiver.parts.verify(c) == "" for c in receiver.parts.copies(2))

    slow = PeerSender(2, [endpoint(receiver)], SECRET, timeout=2.0, kind=wire.PART)
    for step in (7, 8, 9):  # not started: nothing goes, as on a link slower than the steps
        slow.offer(snapshot(tmp_path, step, size=4096))  # returns: it never waits for one
    assert slow.stats()["counts"] == {"dropped": 2}  # 7 and 8; 9 is the one that waits


def test_a_corrupt_held_copy_fails_verification(receiver, tmp_path):
    sender = PeerSender(2, [endpoint(receiver)], SECRET, timeout=2.0).start()
    sender.offer(snapshot(tmp_path, 5))
    assert sender.wait_sent(5, 20)
    sender.close()
    copy = receiver.held.newest(2)
    with open(copy.snapshot.path, "r+b") as fh:
        fh.seek(1000)
        fh.write(b"\xff")
    assert receiver.held.verify(copy) == "sha256 differs from the record"
    copy.snapshot.path.write_bytes(b"short")
    assert receiver.held.verify(copy) == f"5 bytes, {3 << 20} recorded"


def test_a_sender_without_the_jobs_secret_stores_nothing(receiver, tmp_path):
    sender = PeerSender(2, [endpoint(receiver)], b"x" * 32, timeout=2.0).start()
    sender.offer(snapshot(tmp_path, 1))
    assert sender.wait_sent(1, 20)
    sender.close()
    wait_counts(receiver, "unauthenticated")
    assert receiver.held.copies(2) == []
    assert sender.stats()["holders"][0]["stored_step"] is None


def test_a_copy_of_a_rank_not_held_here_is_refused(receiver, tmp_path):
    sender = PeerSender(3, [endpoint(receiver)], SECRET, timeout=2.0).start()
    sender.offer(snapshot(tmp_path, 1, rank=3))
    assert sender.wait_sent(1, 20)
    sender.close()
    assert sender.stats()["counts"] == {"refused": 1}
    assert receiver.held.held_ranks() == []


def _raw_push(rx, payload: bytes, claimed: bytes, close_after: int | None = None) -> bytes:
    """A transfer by hand: ``payload`` sent, ``claimed``'s sha256 in the trailer."""
    import hashlib

    with socket.create_connection((LOOPBACK, rx.port), timeout=5) as sock:
        hello = wire.recv_exact(sock, len(wire.MAGIC) + wire.NONCE_BYTES)
        nonce = hello[len(wire.MAGIC):]
        raw = json.dumps({"kind": "copy", "from_rank": 2, "to_rank": 0, "rank": 2, "step": 9,
                          "world_size": 4, "digest": "d", "bytes": len(payload)}).encode()
        sock.sendall(struct.pack(">I", len(raw)) + raw + wire.mac(SECRET, b"head", nonce, raw))
        assert wire.recv_exact(sock, 1) == bytes([wire.ACCEPT])
        if close_after is not None:
            sock.sendall(payload[:close_after])
            return b""
        sock.sendall(payload)
        sha = hashlib.sha256(claimed).digest()
        sock.sendall(sha + wire.mac(SECRET, b"tail", nonce, raw, sha))
        return wire.recv_exact(sock, 1)


def test_bytes_that_are_not_what_was_sent_are_dropped(receiver):
    assert _raw_push(receiver, b"a" * 5000, claimed=b"b" * 5000) == bytes([wire.BAD])
    wait_counts(receiver, "bad")
    assert receiver.held.copies(2) == []
    assert list(receiver.held.rank_dir(2).iterdir()) == []      # no half file left


def test_a_sender_that_dies_mid_transfer_leaves_nothing(receiver):
    _raw_push(receiver, b"a" * 50000, claimed=b"", close_after=20000)
    wait_counts(receiver, "incomplete")
    assert list(receiver.held.rank_dir(2).iterdir()) == []


def test_a_full_tmpfs_skips_and_counts_and_keeps_the_copies_it_has(tmp_path):
    """A real 8 MiB tmpfs: a 5 MiB copy fits once; the next is refused by the free-space
    check, and one let past it (no reserve) fails mid-write with ENOSPC: both counted, no
    half file left, the first copy whole."""
    with tmpfs_mount(tmp_path / "shm", "8m") as shm:
        rx = PeerReceiver(LOOPBACK, SECRET, 0, PeerStore(shm / "held"),
                          PeerStore(shm / "fetched"), timeout=2.0, reserve_bytes=0).start()
        rx.hold({2})
        sender = PeerSender(2, [wire.Endpoint(0, LOOPBACK, rx.port)], SECRET, timeout=2.0,
                            max_backoff=0).start()
        try:
            for step in (1, 2):
                sender.offer(snapshot(tmp_path, step, size=5 << 20))
                assert sender.wait_sent(step, 20)
            wait_counts(rx, "skipped_full")
            rx.reserve_bytes = -(1 << 30)          # past the check: the kernel says ENOSPC
            sender.offer(snapshot(tmp_path, 3, size=5 << 20))
            assert sender.wait_sent(3, 20)
            wait_counts(rx, "skipped_full", 2)
        finally:
            sender.close()
            rx.close()
        assert sender.stats()["counts"]["full"] == 1
        copies = rx.held.copies(2)
        assert [c.snapshot.step for c in copies] == [1] and rx.held.verify(copies[0]) == ""
        assert sorted(p.name for p in rx.held.rank_dir(2).iterdir()) == [
            "step-000000000001.json", "step-000000000001.snap"]


def test_a_dead_peer_costs_a_timeout_on_the_senders_thread_never_the_loop(tmp_path):
    with socket.socket() as silent:               # accepts connections, never answers
        silent.bind((LOOPBACK, 0))
        silent.listen(1)
        sender = PeerSender(2, [wire.Endpoint(0, LOOPBACK, silent.getsockname()[1])], SECRET,
                            timeout=0.5).start()
        begun = time.monotonic()
        sender.offer(snapshot(tmp_path, 1))
        offered = time.monotonic() - begun
        assert sender.wait_sent(1, 20)
        sender.offer(snapshot(tmp_path, 2))       # backing off: no second wait
        assert sender.wait_sent(2, 20)
        sender.close()
    assert offered < 0.1
    stats = sender.stats()
    assert stats["counts"] == {"failed": 1, "backing_off": 1}
    assert "timed out" in stats["holders"][0]["last_error"]


def test_a_resume_drops_copies_of_the_lost_history_and_ranks_no_longer_held(receiver, tmp_path):
    sender = PeerSender(2, [endpoint(receiver)], SECRET, timeout=2.0).start()
    for step in (11, 12):
        sender.offer(snapshot(tmp_path, step))
        assert sender.wait_sent(step, 20)
    sender.close()
    store = receiver.held
    assert store.discard_newer_than(11, received_before_ns=time.time_ns()) == 1
    assert [c.snapshot.step for c in store.copies(2)] == [11]
    assert store.discard_newer_than(5, received_before_ns=0) == 0   # arrived later: kept
    assert store.retain({3}) == [2] and store.held_ranks() == []
