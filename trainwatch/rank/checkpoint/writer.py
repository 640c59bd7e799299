"""Write one checkpoint directory atomically: a crash at any moment leaves either the whole
checkpoint or a ``.tmp-`` directory that every reader ignores.

Order: state files into ``.tmp-step-N-...``, the manifest last, fsync the directory,
rename it to ``step-N``, fsync the parent.

Time to durable is what counts, so nothing waits in line: while a file is serialized
into the page cache, a helper thread hashes the part already written (mapped window by
window, no copy) and asks the kernel to start writing it back; the final fsync then only
waits for the tail, and the hash is ready about when the last byte is. A ``check`` of
each tree (the NaN/Inf guard) runs on a helper alongside its file too, and a tree it
rejects stops the save before anything is published.
"""

from __future__ import annotations

import json
import mmap
import os
import platform
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping

import torch

from trainwatch import __version__
from trainwatch.contract.layout import WEIGHTS_CONFIG_DIGEST_KEY
from trainwatch.rundir.atomic import fsync_dir, fsync_file
from trainwatch.rank.checkpoint.writeback import start_writeback
from trainwatch.checkpoint_format.manifest import (DIGEST, FORMAT, FORMAT_VERSION, HASH_CHUNK,
                                                    MANIFEST, digest_algorithm, new_digest,
                                                    rank_file_name, step_dir_name)

HASH_WINDOW = 8 << 20  # hashed (and handed to writeback) this far behind the writer; page-aligned


class CheckpointWriteError(OSError):
    """A save failed; the partial directory is gone (or left as ``.tmp-``, never trusted)."""


class CheckRefused(Exception):
    """``check`` found something in a tree (its list of names); nothing was published."""

    def __init__(self, found: list[str]):
        super().__init__(", ".join(found))
        self.found = found


@dataclass
class Payload:
    """Everything one checkpoint holds, already in host memory."""

    step: int
    shared: Mapping[str, Any]           # name -> state tree; rank 0's copy, same on every rank
    ranks: list[dict[str, Any]]         # per rank: {"rng": ..., "data": ...}
    config_hash: str | None = None
    reason: str = "interval"
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Written:
    path: Path
    bytes: int
    seconds: float


class _HashingFile:
    """A write-only file that counts what passes through it, keeps the OSError of a failed
    write (torch.save turns it into a RuntimeError without the errno), and has a helper
    thread hash it and start its writeback a window behind the writer."""

    def __init__(self, fh: BinaryIO, path: Path, helpers: ThreadPoolExecutor):
        self.fh, self.bytes = fh, 0
        self.error: OSError | None = None
        self._written = threading.Condition()
        self._finished = False
        self.hashed: Future = helpers.submit(self._hash_behind, path)

    def write(self, data: bytes) -> int:
        view = memoryview(data).cast("B")
        try:
            done = 0
            while done < len(view):  # one write(2) stops at 2 GiB, a signal can cut it short
                done += self.fh.write(view[done:])
        except OSError as exc:
            self.error = exc  # the caller's finish() then stops the hash
            raise
        with self._written:
            self.bytes += done
            self._written.notify()
        return done

    def flush(self) -> None:
        self.fh.flush()

    def finish(self) -> None:
        """No more bytes come; the hash takes the tail."""
        with self._written:
            self._finished = True
            self._written.notify()

    def _hash_behind(self, path: Path) -> str:
        digest = new_digest()
        fd = os.open(path, os.O_RDONLY)
        try:
            hashed = 0

            def window_ready() -> bool:
                return self._finished or self.bytes - hashed >= HASH_WINDOW

            while True:
                with self._written:
                    self._written.wait_for(window_ready)
                    finished, written = self._finished, self.bytes
                if self.error is not None:
                    return ""
                end = written if finished else written - (written - hashed) % HASH_WINDOW
                if end > hashed:
                    # the hash releases the GIL on large buffers; windows start page-aligned
                    with mmap.mmap(fd, end - hashed, offset=hashed,
                                   access=mmap.ACCESS_READ) as pages:
                        digest.update(pages)
                    start_writeback(fd, hashed, end - hashed)
                    hashed = end
                if finished:
                    return digest.hexdigest()
        finally:
            os.close(fd)


def data_position(ranks: list[dict[str, Any]]) -> list[Any]:
    """Each rank's data position as JSON when it is plain data (the exact copy is in rank files)."""
    positions = []
    for state in ranks:
        try:
            positions.append(json.loads(json.dumps(state.get("data"))))
        except (TypeError, ValueError):
            positions.append(repr(state.get("data"))[:200])
    return positions


def _save_file(path: Path, obj: Any, do_fsync: bool, helpers: ThreadPoolExecutor
               ) -> tuple[int, Future, Future | None]:
    """Serialize ``obj`` into ``path``; returns its size and the pending hash and fsync."""
    out = None
    try:
        # Unbuffered: tensors arrive as large views and go to the kernel without a copy.
        with open(path, "xb", buffering=0) as fh:
            out = _HashingFile(fh, path, helpers)
            try:
                torch.save(obj, out)
            finally:
                out.finish()
    except (OSError, RuntimeError) as exc:
        cause = out.error if out is not None and out.error is not None else exc
        if isinstance(cause, OSError):
            raise OSError(cause.errno, cause.strerror or str(cause), str(path)) from exc
        raise
    synced = helpers.submit(fsync_file, path) if do_fsync else None
    return out.bytes, out.hashed, synced


def write_manifest(directory: Path, manifest: dict[str, Any], do_fsync: bool) -> None:
    with open(directory / MANIFEST, "x") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.write("\n")
        fh.flush()
        if do_fsync:
            os.fsync(fh.fileno())


def publish(tmp: Path, final: Path, do_fsync: bool) -> None:
    """Rename a finished temporary directory into place, replacing an older one of that name."""
    if do_fsync:
        fsync_dir(tmp)
    replaced = None
    if final.exists():
        replaced = final.with_name(f".replaced-{final.name}-{time.time_ns()}")
        os.rename(final, replaced)
    os.rename(tmp, final)
    if do_fsync:
        fsync_dir(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def tmp_dir(folder: Path, name: str) -> Path:
    return folder / f".tmp-{name}-{os.getpid()}-{time.time_ns()}"


def _cleanup_and_raise(tmp: Path, exc: OSError, what: str) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    left = " (a partial .tmp- directory is left; it is ignored)" if tmp.exists() else ""
    raise CheckpointWriteError(exc.errno, f"{what}: {exc.strerror or exc}{left}",
                               str(getattr(exc, "filename", None) or tmp)) from exc


def write_checkpoint(folder: str | Path, payload: Payload, *, fsync: bool = True,
                     check: Callable[[Any, str], list[str]] | None = None) -> Written:
    """Write ``payload`` as ``folder/step-N``; raises CheckpointWriteError (or CheckRefused
    when ``check(tree, name)`` lists anything), leaving no partial.

    ``payload.shared`` may be a ``Handoff``: each tree is written as soon as it is copied.
    """
    started = time.perf_counter()
    folder = Path(folder)
    name = step_dir_name(payload.step)
    tmp = tmp_dir(folder, name)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        pending: dict[str, tuple[int, Future, Future | None]] = {}
        checked: list[Future] = []
        with ThreadPoolExecutor(max_workers=4, thread_name_prefix="trainwatch-ckpt-io") as helpers:
            # The small per-rank files first: they are ready before any shared tree is.
            for rank, state in enumerate(payload.ranks):
                pending[rank_file_name(rank)] = _save_file(
                    tmp / rank_file_name(rank), {"rank": rank, **state}, fsync, helpers)
            for key, tree in payload.shared.items():
                if check is not None:
                    checked.append(helpers.submit(check, tree, key))
                pending[f"{key}.pt"] = _save_file(tmp / f"{key}.pt", tree, fsync, helpers)
            files: dict[str, Any] = {}
            for fname, (size, hashed, synced) in pending.items():
                if synced is not None:
                    synced.result()  # raises the fsync's OSError (EIO, ENOSPC on some fs)
                files[fname] = {DIGEST: hashed.result(), "bytes": size}
            found = [item for result in checked for item in result.result()]
        if found:
            raise CheckRefused(found)
        manifest = {
            "format": FORMAT, "version": FORMAT_VERSION, "step": payload.step,
            "created_at": time.time(), "reason": payload.reason,
            WEIGHTS_CONFIG_DIGEST_KEY: payload.config_hash, "world_size": len(payload.ranks),
            "shared": sorted(payload.shared), "metrics": payload.metrics,
            "data_position": data_position(payload.ranks),
            "versions": {"torch": torch.__version__, "trainwatch": __version__,
                         "python": platform.python_version()},
            "files": files,
        }
        write_manifest(tmp, manifest, fsync)
        publish(tmp, folder / name, fsync)
    except OSError as exc:
        _cleanup_and_raise(tmp, exc, f"saving checkpoint step {payload.step} failed")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    total = sum(f["bytes"] for f in files.values())
    return Written(folder / name, total, time.perf_counter() - started)


def copy_checkpoint(source: str | Path, folder: str | Path, *, fsync: bool = True) -> Written:
    """Copy a verified checkpoint into ``folder`` (the mirror), atomically, checking hashes."""
    from trainwatch.checkpoint_format.manifest import read_manifest

    started = time.perf_counter()
    source, folder = Path(source), Path(folder)
    manifest = read_manifest(source)
    tmp = tmp_dir(folder, source.name)
    total = 0
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        for fname, entry in sorted(manifest["files"].items()):
            algorithm = digest_algorithm(entry)
            assert algorithm is not None  # read_manifest refused entries without one
            digest = new_digest(algorithm)
            with open(source / fname, "rb") as src, open(tmp / fname, "xb") as dst:
                while chunk := src.read(HASH_CHUNK):
                    digest.update(chunk)
                    dst.write(chunk)
                dst.flush()
                if fsync:
                    os.fsync(dst.fileno())
            if digest.hexdigest() != entry[algorithm]:
                raise OSError(0, f"{fname} changed while being copied", str(source / fname))
            total += entry["bytes"]
        shutil.copyfile(source / MANIFEST, tmp / MANIFEST)
        if fsync:
            with open(tmp / MANIFEST, "rb") as fh:
                os.fsync(fh.fileno())
        publish(tmp, folder / source.name, fsync)
    except OSError as exc:
        _cleanup_and_raise(tmp, exc, f"mirroring {source.name} failed")
    return Written(folder / source.name, total, time.perf_counter() - started)
