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
Nothing is loaded here: the verdict still comes before DCP reads a byte into the job.

    early = EarlyDigests.start(folder, rank)   # first thing in resume
    ... digest = early.digest(directory, name) # the file's digest, or None: hash it now
    early.stop()                               # resume decided: stop hashing what is left
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from trainwatch.checkpoint_format.manifest import DIGEST, READ_CHUNK, new_digest, step_of
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

    def __init__(self, directory: Path | None, names: list[str]):
        self.directory, self.names = directory, names
        self.done: dict[str, tuple[Any, str]] = {}
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def start(cls, folder: Path | None, rank: int) -> "EarlyDigests":
        """Start hashing ``rank``'s ``.distcp`` file of the newest step directory of
        ``folder`` (none there, e.g. a data-parallel checkpoint: nothing starts)."""
        directory = newest_step_dir(folder) if folder is not None else None
        # DCP's FileSystemWriter writes one file a rank by default: tried by name, so no
        # rank lists a directory of every rank's files
        name = f"__{rank}_0.distcp"
        if directory is None or not os.path.isfile(directory / name):
            return cls(None, [])
        early = cls(directory, [name])
        early._thread = threading.Thread(target=early._hash_all, daemon=True,
                                         name="trainwatch-early-digests")
        early._thread.start()
        return early

    def digest(self, directory: Path, name: str) -> str | None:
        """The xxh3-128 digest of ``directory/name`` hashed here, when it is still the file
        that was hashed; None when it must be hashed now."""
        if self.directory is None or Path(directory) != self.directory or name not in self.names:
            return None
        if self._thread is not None:
            self._thread.join()
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
