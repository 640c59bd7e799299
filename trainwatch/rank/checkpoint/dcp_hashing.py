"""A DCP storage writer that hashes each file as it writes it, so a sharded save never
reads its shards back to put their digests in the manifest.

Reading every shard file again after ``dcp.save`` wrote it cost a sixth of a sharded
save (docs/benchmarks.md). DCP's ``FileSystemWriter`` writes through its ``fs`` object's
``create_stream`` (the extension point its fsspec writer uses too), so a ``FileSystem``
whose streams hash what passes through them gives every file's digest and size the
moment it is closed, at memory speed (xxh3), with no second pass and no extra buffer.
A file DCP wrote some other way (a future torch) is simply not in ``written``; the caller
hashes it from disk then. When DCP will fsync its files, each finished 8 MiB window is
handed to the kernel's writeback as it is written (writeback.py), so the disk works
while DCP still serializes instead of all at the fsync.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Generator, cast

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

from trainwatch.checkpoint_format.manifest import DIGEST, new_digest
from trainwatch.rank.checkpoint.writeback import start_writeback
from trainwatch.rank.checkpoint.writer import HASH_WINDOW


class HashingStream:
    """A file being written that hashes and counts every byte handed to it; with
    ``writeback``, the kernel is asked to start writing each finished 8 MiB to disk (as
    the data-parallel writer does), so the fsync at the end waits only for the tail."""

    def __init__(self, raw: BinaryIO, *, writeback: bool = False):
        self.raw, self.bytes = raw, 0
        self.digest = new_digest()
        self._written_back = 0 if writeback else None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = self.raw.write(view)
        done = len(view) if done is None else done  # a buffered file takes it all or raises
        self.digest.update(view[:done])
        self.bytes += done
        if self._written_back is not None and self.bytes - self._written_back >= HASH_WINDOW:
            end = self.bytes - self.bytes % HASH_WINDOW
            start_writeback(self.raw.fileno(), self._written_back, end - self._written_back)
            self._written_back = end
        return done

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        self.raw.close()

    def writable(self) -> bool:
        return True

    def entry(self) -> dict[str, Any]:
        """What the manifest records of the file: its digest and size."""
        return {DIGEST: self.digest.hexdigest(), "bytes": self.bytes}


class HashingFileSystem(FileSystem):
    """DCP's local file system, recording each written file's digest by name."""

    def __init__(self, *, writeback: bool = False) -> None:
        super().__init__()
        self.writeback = writeback
        self.written: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()  # DCP may write with several threads

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str
                      ) -> Generator[Any, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = HashingStream(cast(BinaryIO, raw), writeback=self.writeback)
            yield stream
        with self._lock:  # closed without an error: complete
            self.written[Path(path).name] = stream.entry()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)  # DCP writes .metadata.tmp, then renames it
        with self._lock:
            entry = self.written.pop(Path(path).name, None)
            if entry is not None:
                self.written[Path(new_path).name] = entry


class HashingWriter(FileSystemWriter):
    """``FileSystemWriter`` whose ``fs.written`` holds {file name: digest, bytes} of what
    this rank wrote."""

    def __init__(self, path: str | os.PathLike, *, sync_files: bool = True):
        super().__init__(path, sync_files=sync_files)
        self.fs: HashingFileSystem = HashingFileSystem(writeback=sync_files)

    @property
    def written(self) -> dict[str, dict[str, Any]]:
        return self.fs.written
