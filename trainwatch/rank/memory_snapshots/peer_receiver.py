"""A rank's receiver of peer copies: a listening socket and a thread per connection.

It keeps the newest copies of the ranks it holds (``hold``) in ``<root>/held`` (at most
``keep`` files per held rank, the arriving one counted: the oldest goes first), and at
resume the snapshots it was told to expect (``expect``) in its ``fetched`` store, and the
held ranks' per-step parts (their RNGs and data position, a few KB each step) in its
``parts`` store, ``keep`` per rank: a node whose every rank died has them here. A copy is
written under a dot-name and renamed into place only once its sha256 and the sender's MAC
check out (peer_wire.py). It never blocks the training loop: it runs on its own threads,
every socket has a timeout, at most ``max_connections`` are served at once (more are
closed), and a copy that would leave less than ``reserve_bytes`` free on the tmpfs is
refused and counted (``skipped_full``), as is one the disk refuses mid-write.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
from collections import Counter
from typing import Any

from trainwatch.rank.memory_snapshots import peer_wire as wire
from trainwatch.rank.memory_snapshots.peer_store import HeldCopy, PeerStore, SnapshotFile, secure_dir

log = logging.getLogger(__name__)

RESERVE_BYTES = 64 << 20  # left free on the tmpfs for the rank's own snapshots


class PeerReceiver:
    def __init__(self, host: str, secret: bytes, rank: int, held: PeerStore,
                 fetched: PeerStore, *, keep: int = 2, reserve_bytes: int = RESERVE_BYTES,
                 timeout: float = 10.0, max_connections: int = 4,
                 parts: PeerStore | None = None):
        self.host, self._secret, self.rank = host, secret, rank
        self.held, self.fetched = held, fetched
        self.parts = parts if parts is not None else PeerStore(held.base.parent / "held-parts")
        self.keep, self.reserve_bytes, self.timeout = keep, reserve_bytes, timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Condition()
        self._holding: set[int] = set()
        self._expected: dict[int, tuple[int, str]] = {}   # fetch: rank -> (step, digest)
        self._arrived: dict[int, HeldCopy] = {}
        self._busy: set[tuple[str, int]] = set()
        self.counts: Counter[str] = Counter()
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    def __repr__(self) -> str:  # never the secret
        return f"PeerReceiver(rank={self.rank}, {self.host}:{self.port})"

    def start(self) -> "PeerReceiver":
        secure_dir(self.held.base)
        secure_dir(self.fetched.base)
        secure_dir(self.parts.base)
        self.held.clear_arrivals()
        self.parts.clear_arrivals()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        sock.listen(16)
        sock.settimeout(0.5)  # how soon close() is noticed
        self._sock, self.port = sock, sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"trainwatch-peer-receiver-{self.rank}")
        self._thread.start()
        return self

    def hold(self, ranks: set[int]) -> None:
        """The ranks whose copies this rank keeps (the layout's ``held_by``)."""
        with self._lock:
            self._holding = set(ranks)

    def expect(self, rank: int, step: int, digest: str) -> None:
        """At resume: accept ``rank``'s snapshot of ``step`` with ``digest`` when fetched."""
        with self._lock:
            self._expected[rank] = (step, digest)
            self._arrived.pop(rank, None)

    def wait_fetched(self, timeout: float) -> dict[int, HeldCopy]:
        """Wait until every expected snapshot arrived or ``timeout``; those that did."""
        with self._lock:
            self._lock.wait_for(lambda: set(self._arrived) >= set(self._expected), timeout)
            return dict(self._arrived)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._sock is not None:
            self._sock.close()

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (socket.timeout, BlockingIOError):
                continue
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                self._count("over_capacity")
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name=f"trainwatch-peer-copy-{self.rank}").start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(self.timeout)
                self._count(self._receive(conn))
        except (wire.WireError, OSError) as exc:
            self._count("incomplete")
            log.debug("peer copy not received: %s", exc)
        finally:
            self._slots.release()

    def _decide(self, header: dict[str, Any]) -> tuple[int, PeerStore]:
        """The answer to an offered copy, and where it would go."""
        kind, rank = header["kind"], header["rank"]
        if header["to_rank"] != self.rank:
            return wire.REFUSED, self.held
        if kind in (wire.COPY, wire.PART):
            ok = rank in self._holding and header["from_rank"] == rank
            store = self.held if kind == wire.COPY else self.parts
        else:
            ok = self._expected.get(rank) == (header["step"], header["digest"])
            store = self.fetched
        if not ok:
            return wire.REFUSED, store
        if (kind, rank) in self._busy:
            return wire.BUSY, store
        keep = 1 if kind == wire.FETCH else self.keep
        fs = os.statvfs(store.base)
        free = fs.f_bavail * fs.f_frsize + store.oldest_to_go(rank, keep)
        if free - header["bytes"] < self.reserve_bytes:
            return wire.FULL, store
        return wire.ACCEPT, store

    def _receive(self, conn: socket.socket) -> str:
        try:
            nonce, raw, header = wire.greet(conn, self._secret)
        except wire.WireError as exc:
            log.warning("peer copy refused: %s", exc)
            return "unauthenticated" if "unauthenticated" in str(exc) else "refused"
        with self._lock:
            status, store = self._decide(header)
            if status == wire.ACCEPT:
                self._busy.add((header["kind"], header["rank"]))
        conn.sendall(bytes([status]))
        if status != wire.ACCEPT:
            return {wire.FULL: "skipped_full"}.get(status, wire.STATUS[status])
        try:
            outcome, reply = self._store(conn, nonce, raw, header, store)
        finally:  # before the reply: the sender's next copy may come the moment it has it
            with self._lock:
                self._busy.discard((header["kind"], header["rank"]))
        if reply is not None:
            conn.sendall(bytes([reply]))
        return outcome

    def _store(self, conn: socket.socket, nonce: bytes, raw: bytes, header: dict[str, Any],
               store: PeerStore) -> tuple[str, int | None]:
        """The arrival written, checked and renamed into place; (outcome, the byte to
        answer, None for none)."""
        rank, step, kind = header["rank"], header["step"], header["kind"]
        store.make_room(rank, 1 if kind == wire.FETCH else self.keep)
        arriving = store.arriving_path(rank, step)
        fd = os.open(arriving, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            try:
                sha = wire.receive_into(conn, fd, header["bytes"])
            finally:
                os.close(fd)
            wire.check_trailer(conn, self._secret, nonce, raw, sha)
        except OSError as exc:
            store.abandon(arriving)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                return "skipped_full", None
            raise
        except wire.WireError as exc:
            store.abandon(arriving)
            log.warning("peer copy of rank %d step %d dropped: %s", rank, step, exc)
            if "closed" in str(exc):
                return "incomplete", None
            return "bad", wire.BAD
        snapshot = SnapshotFile(rank, step, header["world_size"], header["digest"], arriving)
        try:
            copy = store.commit(arriving, snapshot, header["bytes"], sha, header["from_rank"])
        except OSError as exc:  # no room for the record: the file goes too
            store.abandon(arriving)
            store.remove_orphans(rank)
            return ("skipped_full" if exc.errno in (errno.ENOSPC, errno.EDQUOT)
                    else "incomplete"), None
        if kind == wire.FETCH:
            with self._lock:
                self._arrived[rank] = copy
                self._lock.notify_all()
        return {wire.COPY: "stored", wire.PART: "part_stored"}.get(kind, "fetched"), wire.STORED
