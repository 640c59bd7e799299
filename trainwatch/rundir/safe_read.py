"""The one safe reader of run-directory files: regular files only, no symlink out of the
run directory, sizes capped, JSON parsed depth-safe, status records typed; a bad file is
skipped with a reason code, never a crash or a hang."""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainwatch.contract.layout import (FORMAT_VERSION,
                                       rank_file_name)
from trainwatch.errors import FormatError

# --------------------------------------------------------------------------- reading
#
# Anything can appear in a run directory: a FIFO or a device where a status file should
# be, a symlink to /dev/zero, a file of 200 MB, JSON nested a million deep.  Every reader
# goes through ``open_run_file``/``read_run_file``: regular files only (checked before
# opening, so a device is never opened, and again on the open descriptor), opened
# non-blocking, symlinks that leave the run directory refused, sizes capped before
# reading.  A bad file costs that file only: it is skipped with a reason code.

MAX_RECORD_BYTES = 4 << 20  # a status file, run.json, a dump: writers produce a few KB
MAX_LINE_BYTES = 1 << 20    # one JSON line (journal, metrics log)

# Why a file or line was skipped: the ``reason`` label of the agent's skip counters.
SKIP_REASONS = ("special_file", "outside_run_dir", "too_large", "permission_denied",
                "unreadable", "not_json", "too_deep", "not_object", "alien_format",
                "unsupported_version", "rank_mismatch", "wrong_type")


class SkippedFile(FormatError):
    """A run-directory file a reader will not use; ``reason`` is one of SKIP_REASONS."""

    def __init__(self, path: str | Path, reason: str, detail: str):
        self.path, self.reason, self.detail = str(path), reason, detail
        super().__init__(f"{path}: {detail}")


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def open_run_file(path: str | Path, root: str | Path | None = None) -> tuple[int, os.stat_result]:
    """An O_NONBLOCK descriptor of a regular file (and its stat); SkippedFile otherwise.

    ``root``: symlinks may point anywhere inside it, never out of it.  FileNotFoundError
    passes through (a missing file is not a bad one).
    """
    try:
        before = _stat_inside(path, root)
        if not stat.S_ISREG(before.st_mode):
            raise SkippedFile(path, "special_file", f"{_file_kind(before.st_mode)}, not a "
                              "regular file")
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise
    except PermissionError:
        raise _permission_denied(path) from None
    except OSError as exc:
        raise SkippedFile(path, "unreadable", f"unreadable ({exc.strerror or exc})") from None
    return fd, _regular(fd, path)


_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def _permission_denied(path: str | Path) -> SkippedFile:
    return SkippedFile(path, "permission_denied", "permission denied (docs/run-directory.md: "
                       "Permissions)")


def _regular(fd: int, path: str | Path) -> os.stat_result:
    """The open file's stat; SkippedFile (and the descriptor closed) unless it is a
    regular file (swapped between the check and the open)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise SkippedFile(path, "special_file", f"{_file_kind(st.st_mode)}, not a regular file")
    return st


def _stat_inside(path: str | Path, root: str | Path | None) -> os.stat_result:
    """``os.stat(path)``, once ``path`` is known to stay inside ``root`` (SkippedFile if not).

    Fast path (every status and beat file, every second): ``path`` is spelled as ``root``
    followed by plain names, none of which is a symlink (one lstat each), so it is inside
    whatever ``root`` resolves to. Anything else (a link, ``..``, another spelling) takes
    the full resolution of both.
    """
    if root is None:
        return os.stat(path)
    text, top = os.fspath(path), os.fspath(root).rstrip(os.sep) + os.sep
    names = text[len(top):].split(os.sep) if text.startswith(top) else []
    if names and all(n not in ("", ".", "..") for n in names):
        for i in range(1, len(names) + 1):
            st = os.lstat(top + os.sep.join(names[:i]))  # FileNotFoundError passes through
            if stat.S_ISLNK(st.st_mode):
                break
        else:
            return st
    real, top = os.path.realpath(path), os.path.realpath(root)
    if real != top and not real.startswith(top.rstrip(os.sep) + os.sep):
        raise SkippedFile(path, "outside_run_dir", f"points outside the run directory "
                          f"(to {real})")
    return os.stat(path)


def read_run_file(path: str | Path, root: str | Path | None = None, *,
                  max_bytes: int = MAX_RECORD_BYTES) -> bytes:
    """The bytes of a regular file of at most ``max_bytes``; SkippedFile otherwise."""
    fd, st = open_run_file(path, root)
    return _read_open(fd, st, path, max_bytes)


def _read_open(fd: int, st: os.stat_result, path: str | Path, max_bytes: int) -> bytes:
    """Read and close ``fd``, a regular file: at most ``max_bytes`` or SkippedFile."""
    try:
        if st.st_size > max_bytes:
            raise SkippedFile(path, "too_large", f"{st.st_size} bytes, more than the "
                              f"{max_bytes} a reader takes")
        # The size the stat saw and a byte more: a read of that much is the whole file,
        # without a 1 MiB buffer (mapped and unmapped, at the agent's fixed mmap
        # threshold) and without a read more to find the end (each status and beat file,
        # every second). A file that grew, or a short read before that size (some network
        # and FUSE file systems), reads on.
        chunks, left, got = [], max_bytes + 1, 0
        want = min(left, st.st_size + 1 if st.st_size > 0 else 1 << 20)
        while left > 0:
            try:
                chunk = os.read(fd, want)
            except OSError as exc:
                raise SkippedFile(path, "unreadable",
                                  f"unreadable ({exc.strerror or exc})") from None
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
            got += len(chunk)
            if len(chunk) < want and got >= st.st_size:
                break
            want = min(left, 1 << 20)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # grew after the stat
        raise SkippedFile(path, "too_large", f"more than the {max_bytes} bytes a reader takes")
    return data


def read_run_file_tail(path: str | Path, root: str | Path | None = None, *,
                       max_bytes: int = MAX_RECORD_BYTES, start: int = 0) -> bytes:
    """The last ``max_bytes`` of a regular file (logs, metrics logs), none before offset
    ``start`` (what was written since); SkippedFile otherwise."""
    fd, st = open_run_file(path, root)
    try:
        begin = max(0, start, st.st_size - max_bytes)
        return os.pread(fd, max(0, st.st_size - begin), begin)
    except OSError as exc:
        raise SkippedFile(path, "unreadable", f"unreadable ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


class RunFolder:
    """A folder of the run directory, listed once, whose files are read relative to it:
    no stat per file (every status and beat file, every second).

    The folder is checked like a run file's path (inside the run directory) and opened;
    the listing's file types (``d_type``) tell a plain file without a stat, and it is
    opened relative to the folder without following a link and checked again on its
    descriptor. Anything else (a link, a special file, a type the listing does not
    tell) takes ``read_run_file``'s way.
    """

    def __init__(self, path: str | Path, root: str | Path | None = None):
        self.path, self.root = os.fspath(path), root
        before = _stat_inside(self.path, root)  # FileNotFoundError passes through
        if not stat.S_ISDIR(before.st_mode):
            raise NotADirectoryError(self.path)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            st = os.fstat(self.fd)
            if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
                raise SkippedFile(self.path, "unreadable", "replaced while being opened")
            self.entries = {entry.name: entry for entry in os.scandir(self.fd)}
        except BaseException:
            os.close(self.fd)
            raise

    def __enter__(self) -> "RunFolder":
        return self

    def __exit__(self, *exc: Any) -> None:
        os.close(self.fd)

    def version(self, name: str) -> tuple[int, int, int, int] | None:
        """The listed plain file ``name``'s (inode, size, mtime, ctime in ns), one stat
        without following a link; None when it is not listed, not a plain file or gone.
        A file rewritten by rename (status files) has another version, even when its
        inode number is reused."""
        entry = self.entries.get(name)
        try:
            if entry is None or not entry.is_file(follow_symlinks=False):
                return None
            st = entry.stat(follow_symlinks=False)
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def read(self, name: str, *, max_bytes: int = MAX_RECORD_BYTES) -> bytes:
        """The bytes of the listed file ``name`` (FileNotFoundError when it is not listed
        or is gone), as ``read_run_file`` reads them."""
        path = os.path.join(self.path, name)
        entry = self.entries.get(name)
        if entry is None:
            raise FileNotFoundError(path)
        if not entry.is_file(follow_symlinks=False):
            return read_run_file(path, self.root, max_bytes=max_bytes)
        try:
            fd = os.open(name, _OPEN_FLAGS | os.O_NOFOLLOW, dir_fd=self.fd)
        except FileNotFoundError:
            raise
        except PermissionError:
            raise _permission_denied(path) from None
        except OSError:  # a link since the listing (ELOOP), or unreadable: checked and said
            return read_run_file(path, self.root, max_bytes=max_bytes)
        return _read_open(fd, _regular(fd, path), path, max_bytes)


def parse_json(data: bytes | str) -> tuple[Any, str | None]:
    """JSON, depth-safe: (value, None), or (None, reason) for bytes that are not JSON or
    nest deeper than the interpreter can parse."""
    try:
        return json.loads(data), None
    except RecursionError:
        return None, "too_deep"
    except (ValueError, UnicodeDecodeError):
        return None, "not_json"


@dataclass
class Skipped:
    """A file or line a reader could not use, and why (shown to users, counted by the agent).

    ``reason`` is the human sentence; ``code`` one of SKIP_REASONS (the counters' label).
    """

    path: str
    reason: str
    line: int | None = None
    code: str = "not_json"

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line else self.path
        return f"{where}: {self.reason}"


@dataclass
class ReadResult:
    records: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)


def read_record(path: str | Path, expected_format: str, *, root: str | Path | None = None,
                max_bytes: int = MAX_RECORD_BYTES,
                folder: RunFolder | None = None) -> dict[str, Any]:
    """Read one versioned JSON document (listed in ``folder`` when given); FormatError (a
    SkippedFile with its reason code for anything but a missing file) saying what is wrong
    with it."""
    try:
        raw = read_run_file(path, root, max_bytes=max_bytes) if folder is None else \
            folder.read(os.path.basename(path), max_bytes=max_bytes)
    except FileNotFoundError:
        raise FormatError(f"{path}: missing") from None
    if not raw.strip():
        raise SkippedFile(path, "not_json", "empty file")
    obj, why = parse_json(raw)
    if why == "too_deep":
        raise SkippedFile(path, why, "JSON nested too deeply")
    if why is not None:
        raise SkippedFile(path, why, "torn or not JSON")
    return check_format(obj, expected_format, str(path))


def check_format(obj: Any, expected_format: str, where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise SkippedFile(where, "not_object", "not a JSON object")
    fmt, version = obj.get("format"), obj.get("version")
    if fmt != expected_format:
        raise SkippedFile(where, "alien_format",
                          f"not a {expected_format} file (format={short_value(fmt)})")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise SkippedFile(where, "unsupported_version",
                          f"{expected_format} version {short_value(version)} is not supported "
                          f"(this trainwatch reads version {FORMAT_VERSION})")
    return obj


def short_value(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# Types of the status fields readers rely on (None is always allowed): a file with another
# type is skipped as a whole, so no reader meets a string where it does arithmetic.
_NUMBER = (int, float)
_STATUS_TYPES: dict[str, tuple[type, ...]] = {
    "pid": (int,), "world_size": (int,), "local_rank": (int,), "step": (int,),
    "steps_completed": (int,),
    "restart_count": (int,), "state": (str,), "phase": (str,), "job": (str,), "node": (str,),
    "backend": (str,), "device": (str,), "cgroup": (str,), "heartbeat_at": _NUMBER, "started_at": _NUMBER,
    "last_progress_at": _NUMBER, "phase_since": _NUMBER, "last_nonfinite_loss_at": _NUMBER,
    "last_reduction_mismatch_at": _NUMBER, "reduction": (dict,),
    "metrics": (dict,), "counters": (dict,), "eval": (dict,), "checkpoint": (dict,),
    "timing": (dict,), "info": (dict,), "phase_budgets": (dict,),
}
MAX_RANK = 1 << 24  # far beyond any world size; keeps label values bounded


def check_status(obj: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """A status record whose fields have the documented types and whose rank is the one
    in its file name (a file claiming another rank would shadow or invent a rank)."""
    rank = obj.get("rank")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < MAX_RANK:
        raise SkippedFile(path, "wrong_type", f"rank {short_value(rank)} is not a rank number")
    if os.path.basename(path) != rank_file_name(rank, ".json"):
        raise SkippedFile(path, "rank_mismatch", f"says rank {rank}, its name says otherwise")
    for key, types in _STATUS_TYPES.items():
        value = obj.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            raise SkippedFile(path, "wrong_type",
                              f"'{key}' is {type(value).__name__}, expected "
                              f"{' or '.join(t.__name__ for t in types)}")
    for key in ("heartbeat_at", "started_at", "last_progress_at", "phase_since"):
        value = obj.get(key)
        if isinstance(value, float) and not math.isfinite(value):
            raise SkippedFile(path, "wrong_type", f"'{key}' is not a finite number")
    return obj
