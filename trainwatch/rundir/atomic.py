"""Writing a run directory: files replaced atomically (temporary file, fsync, rename) and
JSON lines appended whole, so a reader never sees a torn record, even on a full disk."""

from __future__ import annotations

import errno
import json
import os
import secrets
from pathlib import Path
from typing import Any


# --------------------------------------------------------------------------- writing

def atomic_write_bytes(path: str | Path, data: bytes, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` so readers see the old or new file, never a torn one.

    ``durable`` also fsyncs the file and its directory, so the new content survives a
    power cut; heartbeats skip that (a lost heartbeat is harmless, fsync is not free).
    """
    path = Path(path)
    fd, tmp = _create_temp(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        fsync_dir(path.parent)


def _create_temp(path: Path) -> tuple[int, str]:
    """A new temporary file beside ``path`` created with mode 0666 filtered by the umask and
    the folder's default ACL, like any file the writer creates: the agent's group reads
    the run directory through them (mkstemp's fixed 0600 would shut it out)."""
    for _ in range(100):
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


def write_once_json(path: str | Path, obj: Any) -> bool:
    """Write ``obj`` at ``path`` unless the name is taken (False then): whole (a finished
    temporary file, hard linked, which fails on a taken name also over NFS), never over
    another writer's file. For records that must exist exactly once."""
    path = Path(path)
    fd, tmp = _create_temp(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(json.dumps(obj).encode() + b"\n")
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        fsync_dir(path.parent)
        return True
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def fsync_file(path: str | Path, flags: int = 0) -> None:
    """fsync a file already written and closed (its data is on disk when this returns)."""
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """fsync a directory so a rename inside it is durable."""
    fsync_file(path, os.O_DIRECTORY)


def atomic_write_json(path: str | Path, obj: Any, *, durable: bool = True) -> None:
    atomic_write_bytes(path, (json.dumps(obj, separators=(",", ":")) + "\n").encode(),
                       durable=durable)


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """Append one JSON line with a single O_APPEND write (whole lines, even with many writers).

    All or nothing: a write cut short (a full disk) is taken back and OSError(ENOSPC) raised,
    so the file never holds half a line that the next append would glue to its own.
    """
    append_lines(path, (json.dumps(record, separators=(",", ":"), default=str)
                        + "\n").encode())


def append_lines(path: str | Path, data: bytes) -> None:
    """Append whole JSON lines (``data`` ends with a newline) with a single O_APPEND write,
    each line all or nothing as in ``append_jsonl``: a rank's metrics log takes a flush's
    lines at once; on a full disk the lines that fitted whole stay, the cut one is taken
    back, and OSError(ENOSPC) is raised."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, data)
        if written < len(data):
            whole = data.rfind(b"\n", 0, written) + 1  # the lines that fitted entirely
            _take_back(fd, path, written - whole)
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} for whole lines "
                          f"({written} of {len(data)} bytes fit; {written - whole} of a cut "
                          "line taken back)", str(path))
    finally:
        os.close(fd)


def _take_back(fd: int, path: str | Path, written: int) -> None:
    """Undo the first ``written`` bytes of a line an O_APPEND write cut short: truncate them
    away while they end the file; when another writer appended since, end them with a
    newline in place instead (no new space needed), so readers skip them as one torn line."""
    end = os.lseek(fd, 0, os.SEEK_CUR)  # after an O_APPEND write: the end of ours
    if written == 0:
        return
    if os.fstat(fd).st_size == end:
        os.ftruncate(fd, end - written)
        return
    pad = os.open(path, os.O_WRONLY | os.O_CLOEXEC)  # pwrite on an O_APPEND fd would append
    try:
        os.pwrite(pad, b"\n", end - 1)
    finally:
        os.close(pad)
