"""Hash this rank's own DCP shards of the newest checkpoint from the moment resume starts.

At a sharded resume every rank hashes its own ``__<rank>_<n>.distcp`` files (its share,
parallel_verify.py), but only once rank 0 has listed the checkpoints, agreed on memory
snapshots and sent the candidate; until then the other ranks wait, and the hashing
(~14 ms per 96 MiB of xxh3, plus the read) then came on top of that wait. Here a helper
thread starts hashing them at once, in the newest ``step-N`` directory of the checkpoint
folder (the candidate rank 0 tries first, unless it does not verify), while the agreement
runs; xxhash and the reads release the GIL. When rank 0's request names the same file,
unchanged since (same inode, size, mtime and ctime before and after it was hashed), its
digest is taken from here; anything else (another candidate, a file that changed, a read
error) is hashed the usual way, so the verdict is the one hashing at request time gives.
Nothing of the shards is loaded here: the verdict still comes before DCP reads a byte into
the job.

Given the world size, the thread also reads that directory's manifest (``guess``: what the
other ranks hash their share of without waiting for rank 0 to send it, parallel_verify.py)
and loads this rank's own ``rank-NNNNN.pt`` through ``load_verified`` (its bytes hashed and
compared with the manifest's entry before they are unpickled; ~2 ms of weights-only
unpickling that came after the request). The value is handed over (``value``) only for the
same directory and the same manifest entry, and reaches the job only once every rank's
verdict is in.

    early = EarlyDigests.start(folder, rank, world_size)   # first thing in resume
    ... digest = early.digest(directory, name) # the file's digest, or None: hash it now
    ... found, value = early.value(directory, name, entry)  # loaded and verified here
    early.stop()                               # resume decided: stop hashing what is left
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from trainwatch.checkpoint_format.manifest import (DIGEST, READ_CHUNK, new_digest,
                                                    rank_file_name, read_manifest, step_of)
from trainwatch.rank.checkpoint.resume import wanted_files
from trainwatch.rank.checkpoint.verified_load import load_verified
from trainwatch.rundir.safe_read import open_run_file


def _key(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What changes when a file is replaced or written to."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def newest_step_dir(folder: Path) -> Path | None:
    """The ``step-N`` directory of ``folder`` with the highest N (by name alone)."""
    try:
        names = [e.name for e in os.scandir(folder) if step_of(e.name) is not None]
    except OSError:
        return None
    return folder / max(names, key=lambda n: step_of(n) or 0) if names else None


class EarlyDigests:
    """{file name: (its stat key, its digest)} of this rank's shard files in one
    directory, filled by a helper thread."""

    def __init__(self, directory: Path | None, names: list[str], *, rank: int | None = None,
                 world_size: int | None = None):
        self.directory, self.names = directory, names
        self.done: dict[str, tuple[Any, str]] = {}
        self.manifest: dict[str, Any] | None = None  # the directory's, read here (world_size)
        self.loaded: dict[str, tuple[dict[str, Any], Any]] = {}  # name: (its entry, value)
        self._rank, self._world_size = rank, world_size
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def start(cls, folder: Path | None, rank: int, world_size: int | None = None
              ) -> "EarlyDigests":
        """Start hashing ``rank``'s ``.distcp`` file of the newest step directory of
        ``folder`` (none there, e.g. a data-parallel checkpoint: nothing starts). With
        ``world_size``, also read that directory's manifest and load this rank's own rank
        file (any layout: a data-parallel checkpoint has no shard to hash)."""
        directory = newest_step_dir(folder) if folder is not None else None
        # DCP's FileSystemWriter writes one file a rank by default: tried by name, so no
        # rank lists a directory of every rank's files
        name = f"__{rank}_0.distcp"
        if directory is None:
            return cls(None, [])
        if world_size is not None:
            early = cls(directory, [name], rank=rank, world_size=world_size)
        elif os.path.isfile(directory / name):
            early = cls(directory, [name])
        else:
            return cls(None, [])
        early._thread = threading.Thread(target=early._run, daemon=True,
                                         name="trainwatch-early-digests")
        early._thread.start()
        return early

    def guess(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest step directory and its manifest as read here (``read_manifest``), the
        candidate rank 0 tries first unless it does not verify; None when none was read."""
        self._join()
        if self.directory is None or self.manifest is None:
            return None
        return self.directory, self.manifest

    def value(self, directory: Path, name: str, entry: dict[str, Any]) -> tuple[bool, Any]:
        """(True, ``torch.load`` of ``directory/name``) when it was loaded here, its bytes
        of this very manifest ``entry`` (size and digest checked before unpickling); else
        (False, None): load it now. Handed over once."""
        if self.directory is None or Path(directory) != self.directory:
            return False, None
        self._join()
        found = self.loaded.pop(name, None)
        if found is None or found[0] != entry:
            return False, None
        return True, found[1]

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def digest(self, directory: Path, name: str) -> str | None:
        """The xxh3-128 digest of ``directory/name`` hashed here, when it is still the file
        that was hashed; None when it must be hashed now."""
        if self.directory is None or Path(directory) != self.directory or name not in self.names:
            return None
        self._join()
        found = self.done.get(name)
        if found is None:
            return None
        try:
            now = _key(os.stat(self.directory / name))
        except OSError:
            return None
        return found[1] if now == found[0] else None

    def stop(self) -> None:
        """The resume has decided: hash no more (a file being hashed is left half done)."""
        self._stopped.set()

    def _run(self) -> None:
        # the hashing first: it leaves the GIL to the job's thread, which lists and agrees
        # meanwhile; the reading and unpickling after, while it waits in those collectives
        self._hash_all()
        if self._world_size is not None:
            self._read_and_load()

    def _read_and_load(self) -> None:
        """The manifest, then this rank's own rank file loaded through ``load_verified``
        (a file that does not verify is left to the request: its problem is worded there)."""
        assert self.directory is not None and self._rank is not None
        if self._stopped.is_set():
            return
        try:
            self.manifest = read_manifest(self.directory)
            name = rank_file_name(self._rank)
            entry = self.manifest["files"].get(name)
            assert self._world_size is not None
            if entry is None or name not in wanted_files(self.manifest, self._rank,
                                                         self._world_size):
                return
            value, problem = load_verified(self.directory, name, entry)
        except Exception:  # the usual reading at request time says what is wrong
            return
        if problem is None:
            self.loaded[name] = (entry, value)

    def _hash_all(self) -> None:
        assert self.directory is not None
        buffer = bytearray(READ_CHUNK)
        view = memoryview(buffer)
        for name in self.names:
            if self._stopped.is_set():
                return
            try:
                fd, before = open_run_file(self.directory / name)
                digest = new_digest(DIGEST)
                with os.fdopen(fd, "rb", buffering=0) as fh:
                    while count := fh.readinto(buffer):
                        if self._stopped.is_set():
                            return
                        digest.update(view[:count])
                    after = os.fstat(fh.fileno())
            except Exception:  # the usual hashing at request time says what is wrong
                continue
            if _key(before) == _key(after):
                self.done[name] = (_key(after), digest.hexdigest())
