"""Load a checkpoint's ``.pt`` file in one pass over its bytes, checking its digest on the way.

Resume read every file twice: once to check its digest against the manifest, then again in
``torch.load`` — at 289 MB the first pass alone was a fifth of ``torch.load`` +
``load_state_dict`` (docs/benchmarks.md). Here each tensor's bytes are read once, straight
into the memory that becomes its storage (as ``torch.load`` does), and hashed chunk by
chunk while the chunk is still in the CPU's cache; the file's other bytes (zip headers,
the pickle) are read and hashed in order between them. Only when the digest matches is
the pickle unpickled (``weights_only``, torch's own loader, ``_load``) over those storages:
a corrupt file is never parsed, its tensors never reach the job.

    value, problem = load_verified(directory, "model.pt", manifest["files"]["model.pt"])

Where this torch's loader does not take storages (``_load``'s ``overall_storage``, the
``mmap=True`` path) or the zip directory cannot be read, it falls back to two passes
(``check_file`` then ``torch.load``): the same verdict, the old speed.
"""

from __future__ import annotations

import functools
import inspect
import os
from pathlib import Path
from typing import Any

import torch

from trainwatch.checkpoint_format.manifest import (READ_CHUNK, check_file, digest_algorithm,
                                                    digest_mismatch, hash_problem, new_digest)
from trainwatch.errors import FormatError
from trainwatch.rundir.safe_read import open_run_file


def load_verified(directory: Path, name: str, entry: dict[str, Any]) -> tuple[Any, str | None]:
    """(``torch.load(directory/name, map_location="cpu", weights_only=True)``, None) when the
    file has the size and digest of its manifest ``entry``; (None, what is wrong) when not,
    worded as ``check_file`` words it."""
    size, problem = check_file(directory, name, entry, full=False)
    if problem:
        return None, problem
    path = directory / name
    records = _records(path, size) if _one_pass_supported() else None
    if records is None:
        size, problem = check_file(directory, name, entry)
        return (None, problem) if problem else (_torch_load(path), None)
    algorithm = digest_algorithm(entry)
    assert algorithm is not None  # read_manifest refused entries without one
    try:
        digest, small, storages = _read(path, records, size, algorithm)
    except (OSError, FormatError) as exc:
        return None, hash_problem(name, exc)
    if digest != entry[algorithm]:
        return None, digest_mismatch(name, algorithm)
    try:
        return _unpickle(records, small, storages), None
    except Exception:  # this torch's loader differs after all: torch.load says what it says
        return _torch_load(path), None


def _torch_load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


@functools.cache
def _one_pass_supported() -> bool:
    """This torch's ``serialization._load`` takes the storages (``overall_storage``)."""
    loader = getattr(torch.serialization, "_load", None)
    try:
        return (loader is not None and hasattr(torch, "_weights_only_unpickler")
                and "overall_storage" in inspect.signature(loader).parameters)
    except (TypeError, ValueError):
        return False


# name -> (data offset, size, local header offset), in file order
Records = dict[str, tuple[int, int, int]]


def _records(path: Path, size: int) -> Records | None:
    """Where each record of the zip lies, from its central directory; None when that cannot
    be read or does not tile the file (a damaged file: the two-pass check names it)."""
    try:
        reader = torch._C.PyTorchFileReader(str(path))
        records = {n: (reader.get_record_offset(n), reader.get_record_size(n),
                       reader.get_record_header_offset(n)) for n in reader.get_all_records()}
    except Exception:
        return None
    end = 0
    for offset, length, header in sorted(records.values()):
        if header < end or offset < header or offset + length > size:
            return None
        end = offset + length
    return dict(sorted(records.items(), key=lambda item: item[1][0]))


def _read(path: Path, records: Records, size: int, algorithm: str
          ) -> tuple[str, dict[str, bytes], dict[int, torch.UntypedStorage]]:
    """One pass in file order: every tensor record read into its own new storage, the small
    records kept as bytes, every byte hashed just after it is read. FormatError when the
    file is not the size it was a moment ago."""
    digest = new_digest(algorithm)
    small: dict[str, bytes] = {}
    storages: dict[int, torch.UntypedStorage] = {}
    fd, _ = open_run_file(path)
    with os.fdopen(fd, "rb", buffering=0) as fh:
        position = 0
        for name, (offset, length, _header) in records.items():
            digest.update(_exactly(fh, offset - position))  # the local header (and padding)
            if name.startswith("data/"):
                tensor = torch.empty(length, dtype=torch.uint8)
                _read_into(fh, memoryview(tensor.numpy()), digest)
                storages[offset] = tensor.untyped_storage()
            else:
                small[name] = _exactly(fh, length)
                digest.update(small[name])
            position = offset + length
        _read_into(fh, memoryview(bytearray(size - position)), digest)
        if fh.read(1):
            raise FormatError(f"{path}: grew while it was read")
    return digest.hexdigest(), small, storages


def _exactly(fh: Any, count: int) -> bytes:
    buffer = bytearray(count)
    _read_into(fh, memoryview(buffer), None)
    return bytes(buffer)


def _read_into(fh: Any, view: memoryview, digest: Any) -> None:
    """Fill ``view`` from the file a chunk at a time, hashing each chunk while it is hot."""
    done = 0
    while done < len(view):
        count = fh.readinto(view[done:done + READ_CHUNK])
        if not count:
            raise FormatError(f"{fh.name}: shorter than when it was listed")
        if digest is not None:
            digest.update(view[done:done + count])
        done += count


class _Archive:
    """What ``torch.serialization._load`` asks of the zip reader, answered from the bytes
    already read and hashed (never from the file again)."""

    def __init__(self, records: Records, small: dict[str, bytes]):
        self.records, self.small = records, small

    def has_record(self, name: str) -> bool:
        return name in self.records

    def get_record(self, name: str) -> bytes:
        return self.small[name]

    def get_record_offset(self, name: str) -> int:
        return self.records[name][0]

    def get_record_header_offset(self, name: str) -> int:
        return self.records[name][2]

    def get_record_offset_no_read(self, _current: int, name: str, *_: Any) -> int:
        return self.records[name][0]

    def serialization_id(self) -> str:
        record = self.small.get(".data/serialization_id", b"")
        return record.decode("ascii", "replace")


class _Storages:
    """``overall_storage`` for ``_load``: the slice at a record's offset is that record's
    own storage (each tensor owns its memory, as after a plain ``torch.load``)."""

    def __init__(self, storages: dict[int, torch.UntypedStorage]):
        self.storages = storages

    def __getitem__(self, where: slice) -> torch.UntypedStorage:
        storage = self.storages[where.start]
        if storage.nbytes() != where.stop - where.start:
            raise ValueError(f"record at {where.start}: {storage.nbytes()} bytes, "
                             f"the pickle says {where.stop - where.start}")
        return storage


def _unpickle(records: Records, small: dict[str, bytes],
              storages: dict[int, torch.UntypedStorage]) -> Any:
    loader: Any = torch.serialization._load
    return loader(_Archive(records, small), "cpu", torch._weights_only_unpickler,
                  overall_storage=_Storages(storages), encoding="utf-8")
