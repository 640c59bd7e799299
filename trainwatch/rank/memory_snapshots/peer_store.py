"""The peer copies a node holds on disk: list, verify, newest per rank, prune.

A copy is another rank's sealed snapshot file, byte for byte, kept so that a lost node's
state is still in some node's memory (docs/memory-snapshots.md, "Peer copies"). The
snapshot's own format is the snapshotter's and is never read here: a snapshot is a
``SnapshotFile`` (rank, step, world_size, digest, path), ``digest`` being the producer's
own, carried and compared but never recomputed.

Interface:

* ``SnapshotFile``: one sealed snapshot (own or a copy) as the transport and the resume
  exchange see it.
* ``PeerStore(base)``: ``base/rank-NNNNN/step-SSSSSSSSSSSS.snap`` with its record
  ``step-SSSSSSSSSSSS.json`` (rank, step, world_size, digest, bytes, sha256 of the file,
  from_rank, received_ns). ``copies(rank)`` / ``newest(rank)`` / ``held_ranks()`` read,
  ``verify(copy)`` checks the file against its record, ``begin``/``commit``/``abandon``
  take an arriving copy (written under a dot-name, then renamed: a torn arrival is never
  listed), ``make_room`` keeps at most ``keep`` files per rank counting the arriving one,
  ``discard_newer_than``/``retain`` drop what a resume made stale.

Folders are 0700 and files 0600: a snapshot is the whole training state.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from trainwatch.contract.layout import rank_file_name, rank_of_file

SNAP_SUFFIX = ".snap"
RECORD_SUFFIX = ".json"
STEP_PREFIX = "step-"
ARRIVING_PREFIX = ".arriving-"
CHUNK = 1 << 20  # bytes read or written at a time: a transfer's memory, whatever its size


@dataclass(frozen=True)
class SnapshotFile:
    """One sealed snapshot: ``rank``'s state at ``step`` of a ``world_size``-rank job."""

    rank: int
    step: int
    world_size: int
    digest: str
    path: Path


@dataclass(frozen=True)
class HeldCopy:
    """A copy in a ``PeerStore``: the snapshot, and what its arrival recorded."""

    snapshot: SnapshotFile
    bytes: int
    sha256: str
    from_rank: int
    received_ns: int


def secure_dir(path: Path) -> Path:
    """``path`` as a folder of ours, 0700: created if absent; refused (ValueError) when it
    is a link, not a folder, or another user's (someone else's folder in a shared
    /dev/shm could read or plant snapshots)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{path}: not a folder (a link or a file): peer copies need a "
                         "folder of their own; remove it or choose another root")
    if st.st_uid != os.geteuid():
        raise ValueError(f"{path}: owned by uid {st.st_uid}, not this user ({os.geteuid()}): "
                         "choose another root")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def sha256_of(path: Path) -> tuple[int, str]:
    """(size, sha256 hex) of a file, read in chunks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def step_file_name(step: int, suffix: str) -> str:
    return f"{STEP_PREFIX}{step:012d}{suffix}"


def _step_of(name: str) -> int | None:
    stem = name[len(STEP_PREFIX):].split(".", 1)[0] if name.startswith(STEP_PREFIX) else ""
    return int(stem) if stem.isdigit() else None


class PeerStore:
    """The copies under ``base`` (``<root>/held`` for the ring, a rank's ``fetched`` folder
    at resume), one folder per rank whose state they are."""

    def __init__(self, base: Path):
        self.base = Path(base)

    def rank_dir(self, rank: int) -> Path:
        return self.base / rank_file_name(rank, "")

    def held_ranks(self) -> list[int]:
        """Ranks with a folder here, in order."""
        try:
            names = os.listdir(self.base)
        except OSError:
            return []
        ranks = {n: rank_of_file(Path(n)) for n in names}
        return sorted(r for n, r in ranks.items() if r is not None and n == rank_file_name(r, ""))

    def copies(self, rank: int) -> list[HeldCopy]:
        """``rank``'s complete copies (file and record both here), newest step first; a
        record that does not parse is left out (``verify`` is the content check)."""
        folder = self.rank_dir(rank)
        try:
            names = set(os.listdir(folder))
        except OSError:
            return []
        found = []
        for name in names:
            step = _step_of(name)
            if step is None or not name.endswith(RECORD_SUFFIX):
                continue
            snap = step_file_name(step, SNAP_SUFFIX)
            copy = self._read_record(folder / name, folder / snap) if snap in names else None
            if copy is not None and copy.snapshot.rank == rank and copy.snapshot.step == step:
                found.append(copy)
        return sorted(found, key=lambda c: (c.snapshot.step, c.received_ns), reverse=True)

    def newest(self, rank: int) -> HeldCopy | None:
        copies = self.copies(rank)
        return copies[0] if copies else None

    @staticmethod
    def _read_record(record: Path, snap: Path) -> HeldCopy | None:
        try:
            doc = json.loads(record.read_bytes()[:65536])
            return HeldCopy(SnapshotFile(int(doc["rank"]), int(doc["step"]),
                                         int(doc["world_size"]), str(doc["digest"]), snap),
                            int(doc["bytes"]), str(doc["sha256"]), int(doc["from_rank"]),
                            int(doc["received_ns"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @staticmethod
    def verify(copy: HeldCopy) -> str:
        """'' when the file is whole (its size and sha256 are the record's), else why not."""
        try:
            size, digest = sha256_of(copy.snapshot.path)
        except OSError as exc:
            return f"unreadable: {exc.strerror or exc}"
        if size != copy.bytes:
            return f"{size} bytes, {copy.bytes} recorded"
        return "" if digest == copy.sha256 else "sha256 differs from the record"

    def arriving_path(self, rank: int, step: int) -> Path:
        """Where an arriving copy is written (a dot-name ``copies`` never lists)."""
        return secure_dir(self.rank_dir(rank)) / (ARRIVING_PREFIX + step_file_name(step, SNAP_SUFFIX))

    def make_room(self, rank: int, keep: int) -> list[HeldCopy]:
        """Before a copy of ``rank`` arrives: leave at most ``keep - 1`` complete copies
        (the most recently received), so the arrival makes ``keep``; the ones removed."""
        copies = sorted(self.copies(rank), key=lambda c: c.received_ns, reverse=True)
        for copy in copies[max(keep - 1, 0):]:
            self._remove(copy.snapshot.path)
        self.remove_orphans(rank)
        return copies[max(keep - 1, 0):]

    def remove_orphans(self, rank: int) -> None:
        """Files whose record was never written (a receiver that died or ran out of room
        between the two renames): counted nowhere, so they would only take memory."""
        folder = self.rank_dir(rank)
        try:
            names = set(os.listdir(folder))
        except OSError:
            return
        for name in names:
            if name.startswith(STEP_PREFIX) and name.endswith(SNAP_SUFFIX) and \
                    name[:-len(SNAP_SUFFIX)] + RECORD_SUFFIX not in names:
                self._remove_file(folder / name)

    def oldest_to_go(self, rank: int, keep: int) -> int:
        """Bytes ``make_room(rank, keep)`` would free."""
        copies = sorted(self.copies(rank), key=lambda c: c.received_ns, reverse=True)
        return sum(c.bytes for c in copies[max(keep - 1, 0):])

    def commit(self, arriving: Path, snapshot: SnapshotFile, size: int, sha256: str,
               from_rank: int) -> HeldCopy:
        """An arrival verified: the file renamed into place, then its record written."""
        folder = arriving.parent
        snap = folder / step_file_name(snapshot.step, SNAP_SUFFIX)
        record = folder / step_file_name(snapshot.step, RECORD_SUFFIX)
        self._remove(snap)  # the same step again: the record goes with the old file
        os.replace(arriving, snap)
        copy = HeldCopy(SnapshotFile(snapshot.rank, snapshot.step, snapshot.world_size,
                                     snapshot.digest, snap), size, sha256, from_rank,
                        time.time_ns())
        doc = {k: v for k, v in asdict(copy).items() if k != "snapshot"}
        doc |= {k: v for k, v in asdict(copy.snapshot).items() if k != "path"}
        tmp = folder / (ARRIVING_PREFIX + record.name)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, json.dumps(doc, sort_keys=True).encode())
        finally:
            os.close(fd)
        os.replace(tmp, record)
        return copy

    def adopt(self, snapshot: SnapshotFile) -> SnapshotFile:
        """A copy held elsewhere on this node, linked into this store (no bytes copied), so
        the node's held folder can be tidied while this rank still has to load it."""
        folder = secure_dir(self.rank_dir(snapshot.rank))
        target = folder / step_file_name(snapshot.step, SNAP_SUFFIX)
        self._remove_file(target)
        os.link(snapshot.path, target)
        return SnapshotFile(snapshot.rank, snapshot.step, snapshot.world_size, snapshot.digest,
                            target)

    @staticmethod
    def abandon(arriving: Path) -> None:
        try:
            arriving.unlink()
        except OSError:
            pass

    def discard_newer_than(self, step: int, received_before_ns: int | None = None) -> int:
        """Drop every copy of a step after ``step`` (a resume from ``step`` made them
        another history's) that arrived before ``received_before_ns`` (later ones are of
        the resumed history); how many."""
        dropped = 0
        for rank in self.held_ranks():
            for copy in self.copies(rank):
                if copy.snapshot.step > step and (
                        received_before_ns is None or copy.received_ns < received_before_ns):
                    self._remove(copy.snapshot.path)
                    dropped += 1
        return dropped

    def retain(self, ranks: set[int]) -> list[int]:
        """Drop the folders of ranks this node no longer holds (a new layout after a
        restart); the ranks dropped."""
        dropped = [r for r in self.held_ranks() if r not in ranks]
        for rank in dropped:
            folder = self.rank_dir(rank)
            for name in os.listdir(folder):
                self._remove_file(folder / name)
            try:
                folder.rmdir()
            except OSError:
                pass
        return dropped

    def clear_arrivals(self) -> None:
        """Remove arrivals a dead receiver left half written."""
        for rank in self.held_ranks():
            folder = self.rank_dir(rank)
            for name in os.listdir(folder):
                if name.startswith(ARRIVING_PREFIX):
                    self._remove_file(folder / name)

    @staticmethod
    def _remove(snap: Path) -> None:
        """A copy: its record first (so it stops being listed), then the file."""
        PeerStore._remove_file(snap.with_suffix(RECORD_SUFFIX))
        PeerStore._remove_file(snap)

    @staticmethod
    def _remove_file(path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
