"""The run directory: the one place a run leaves its state.

Layout and record formats are documented in docs/run-directory.md and are
versioned (``FORMAT_VERSION``).  Every writer here writes atomically (temp
file + rename) or appends whole lines; every reader tolerates torn, empty,
alien or future-version files by skipping them and saying why.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import logging
import math
import os
import secrets
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from trainwatch.contract.layout import (CHECKPOINT_DIRS_KEY, CLOSED_EVENT, FORMAT_VERSION,
                                       METRICS_FILE_GLOB, RUN_FORMAT, STATUS_FILE_GLOB,
                                       STATUS_FORMAT, RunLayout, rank_file_name, rank_of_file)
from trainwatch.contract.states import BAD_INPUT, FAILED, FINISHED
from trainwatch.errors import ConfigError, FormatError
from trainwatch.node import boot_id, node_name

log = logging.getLogger(__name__)

__all__ = ["FORMAT_VERSION", "RUN_FORMAT", "STATUS_FORMAT", "RunDir", "Skipped", "ReadResult",
           "atomic_write_bytes", "atomic_write_json", "append_jsonl", "read_record",
           "read_jsonl", "parse_jsonl_line", "parse_jsonl_pieces", "iter_run_dirs", "pick_run_dir"]

# Journal event names written by trainwatch itself.  Readers must accept
# names they do not know (newer writers may add some).
EVENTS = (
    "run_started", "rank_started", "step_milestone", "validation", "finished", "failed",
    "restarted", "launcher_started", "launcher_exited",
    "checkpoint_saved", "checkpoint_failed", "checkpoint_skipped", "checkpoint_pruned",
    "checkpoint_fallback", "checkpoint_resumed", "checkpoint_requested",
    "nonfinite_detected", "data_skipped", "fault_injected",
    "alert_firing", "alert_resolved", "action_taken", "action_skipped", "action_guard_cleared",
    "diagnostics_dumped",
    "job_started", "job_stopped", "job_exited", "job_silent", "controller_started", "controller_stopped",
    "leftovers_stopped", "leftovers_unchecked",
    "supervisor_tree_gone", "supervisor_tree_left", "second_supervisor_exited", CLOSED_EVENT,
)


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
        chunks, left = [], max_bytes + 1
        while left > 0:
            try:
                chunk = os.read(fd, min(left, 1 << 20))
            except OSError as exc:
                raise SkippedFile(path, "unreadable",
                                  f"unreadable ({exc.strerror or exc})") from None
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
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
                          f"not a {expected_format} file (format={_short(fmt)})")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise SkippedFile(where, "unsupported_version",
                          f"{expected_format} version {_short(version)} is not supported "
                          f"(this trainwatch reads version {FORMAT_VERSION})")
    return obj


def _short(value: Any) -> str:
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
        raise SkippedFile(path, "wrong_type", f"rank {_short(rank)} is not a rank number")
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


def parse_jsonl_line(line: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """One JSON-lines record, or why it is skipped; ``(None, None)`` for a blank line.

    The one definition of a torn or alien line, shared by ``read_jsonl`` and the agent's
    incremental journal reader.
    """
    if not line.strip():
        return None, None
    obj, why = parse_json(line)
    if why == "too_deep":
        return None, "nested too deeply"
    if why is not None:
        # A torn last line is what a crash mid-append leaves; say so plainly.
        return None, "torn or not JSON"
    if not isinstance(obj, dict):
        return None, "not a JSON object"
    version = obj.get("v", 1)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        return None, f"record version {_short(version)} not supported"
    return obj, None


# Every JSON line trainwatch writes starts with its record version: where a torn fragment
# (a crash mid-append, an older writer on a full disk) has a whole line glued to it, the
# whole line starts at one of these.
RECORD_START = b'{"v":'


def parse_jsonl_pieces(line: bytes) -> list[tuple[dict[str, Any] | None, str | None]]:
    """``parse_jsonl_line`` of one line, resynchronised: a line that is not JSON but ends in
    a whole record glued to a torn fragment gives the fragment's skip reason, then the
    record (a torn line costs itself, never the next one)."""
    first = parse_jsonl_line(line)
    if first[1] != "torn or not JSON":
        return [first]
    at = line.find(RECORD_START, 1)
    while at > 0:
        obj, reason = parse_jsonl_line(line[at:])
        if reason != "torn or not JSON":
            return [first, (obj, reason)]
        at = line.find(RECORD_START, at + 1)
    return [first]


# json.loads(bytes) guesses the encoding, decodes and strips whitespace around the value
# before the C scanner runs; a line as trainwatch writes it ('{...}\n', UTF-8) goes to the
# scanner directly, several times cheaper per line for a reader of millions of lines.
_SCAN = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _plain_record(line: bytes) -> dict[str, Any] | None:
    """The record of a line in the writer's own form (an object from its first byte, a
    supported version), or None: then ``parse_jsonl_pieces`` decides, exactly as before
    (whatever this accepts, ``json.loads`` reads the same)."""
    try:
        text = line.decode()
        obj, end = _SCAN(text, 0)
    except Exception:  # not JSON, or not in the plain form: the full reader says why
        return None
    if type(obj) is not dict or (end != len(text) and text[end:] != "\n"):
        return None
    version = obj.get("v", 1)
    return obj if type(version) is int and version <= FORMAT_VERSION else None


def line_skip_code(reason: str) -> str:
    """The SKIP_REASONS code of a ``parse_jsonl_line`` reason."""
    return {"nested too deeply": "too_deep", "torn or not JSON": "not_json",
            "not a JSON object": "not_object"}.get(reason, "unsupported_version")


def iter_jsonl(path: str | Path, skipped: list[Skipped], root: str | Path | None = None, *,
               max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, dict[str, Any]]]:
    """Stream a JSON-lines file as (line number, record), appending torn, alien or overlong
    lines to ``skipped``: memory stays one line, however long the file."""
    try:
        fd, _ = open_run_file(path, root)
    except FileNotFoundError:
        return
    except SkippedFile as exc:
        skipped.append(Skipped(str(path), exc.detail, code=exc.reason))
        return
    with os.fdopen(fd, "rb") as fh:
        lineno, long_line = 0, False
        while True:
            try:
                line = fh.readline(max_line_bytes + 1)
            except OSError as exc:
                skipped.append(Skipped(str(path), f"unreadable ({exc.strerror or exc})",
                                       code="unreadable"))
                break
            if not line:
                break
            if long_line:  # the rest of a line already skipped
                long_line = not line.endswith(b"\n")
                continue
            lineno += 1
            if len(line) > max_line_bytes:
                long_line = not line.endswith(b"\n")
                skipped.append(Skipped(str(path), f"line longer than {max_line_bytes} "
                                       "bytes", lineno, code="too_large"))
                continue
            record = _plain_record(line)
            if record is not None:
                yield lineno, record
                continue
            for obj, reason in parse_jsonl_pieces(line):
                if reason is not None:
                    skipped.append(Skipped(str(path), reason, lineno,
                                           code=line_skip_code(reason)))
                elif obj is not None:
                    yield lineno, obj


def read_jsonl(path: str | Path, root: str | Path | None = None, *,
               max_line_bytes: int = MAX_LINE_BYTES) -> ReadResult:
    """Read a JSON-lines file, skipping (and reporting) torn, alien or overlong lines."""
    result = ReadResult()
    result.records = [obj for _, obj in iter_jsonl(path, result.skipped, root,
                                                   max_line_bytes=max_line_bytes)]
    return result


# --------------------------------------------------------------------------- the directory

class RunDir(RunLayout):
    """Typed reading and writing of one run directory (paths: ``RunLayout``)."""

    # setup -------------------------------------------------------------------
    def create(self) -> "RunDir":
        """Create the layout; an unwritable location is a ConfigError (exit 2)."""
        try:
            for d in (self.root, self.status_dir, self.metrics_dir, self.checkpoint_dir,
                      self.diagnostics_dir, self.control_dir, self.logs_dir, self.tmp_dir):
                d.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".write-probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(f"run directory is not writable: {exc.strerror}",
                              file=str(self.root)) from None
        return self

    def exists(self) -> bool:
        return self.root.is_dir()

    # run metadata --------------------------------------------------------------
    def write_run_info(self, info: dict[str, Any]) -> None:
        atomic_write_json(self.run_file, {"format": RUN_FORMAT, "version": FORMAT_VERSION,
                                          **info})

    def run_info(self) -> dict[str, Any] | None:
        try:
            return read_record(self.run_file, RUN_FORMAT, root=self.root)
        except FormatError as exc:
            if self.run_file.exists():
                log.warning("%s", exc)
            return None

    def run_name(self, fallback: str | None = None) -> str:
        """The run's one identity, its ``run`` label everywhere (telemetry, agent, alerts,
        receiver): the ``job`` of run.json as whoever created the run directory wrote it,
        else ``fallback`` (a writer's $TRAINWATCH_JOB), else the directory's name."""
        job = (self.run_info() or {}).get("job")
        if isinstance(job, str) and job:
            return job
        return fallback or self.root.resolve().name

    def checkpoint_folders(self) -> list[Path]:
        """Where this run's checkpoints live (run.json's record; see ``RunLayout``)."""
        return self.recorded_checkpoint_folders(self.run_info())

    def record_checkpoint_folders(self, folders: list[Path]) -> None:
        """Note the checkpoint folders in run.json, so every reader finds them."""
        info = self.run_info() or {}
        recorded = [self.recordable(f) for f in folders]
        if info.get(CHECKPOINT_DIRS_KEY) == recorded:
            return
        info.pop("format", None)
        info.pop("version", None)
        self.write_run_info({**info, CHECKPOINT_DIRS_KEY: recorded})

    # per-rank status ---------------------------------------------------------
    def write_status(self, rank: int, status: dict[str, Any]) -> None:
        atomic_write_json(self.status_file(rank),
                          {"format": STATUS_FORMAT, "version": FORMAT_VERSION, **status},
                          durable=False)

    def statuses(self) -> ReadResult:
        """Every rank's status, newest format only; torn/alien files are skipped and listed."""
        result = ReadResult()
        folder = self.status_folder(result.skipped)
        if folder is None:
            return result
        with folder:
            for path in self.status_files(folder):
                try:
                    result.records.append(self.read_status(path, folder))
                except SkippedFile as exc:
                    result.skipped.append(Skipped(path, exc.detail, code=exc.reason))
                except FormatError:  # vanished between the listing and the read
                    continue
        return result

    def finished_since(self, since: float) -> bool:
        """Every rank of a job started at ``since`` (this host's clock) wrote a ``finished``
        status: training ended, whatever the launcher's exit code says (a rank can crash in
        interpreter teardown, after its last status). Statuses from before ``since`` never
        count, and one whose clock reads earlier (another node's skew) only makes this False."""
        fresh = self.statuses_since(since)
        worlds = {r.get("world_size") for r in fresh}
        if len(worlds) != 1:
            return False
        world = worlds.pop()
        finished = {r.get("rank") for r in fresh if r.get("state") == FINISHED}
        return isinstance(world, int) and world > 0 and finished == set(range(world))

    def rejected_input_since(self, since: float) -> str | None:
        """What a rank of a job started at ``since`` said when it died on bad input (its
        status ``failed`` with ``failure.kind`` bad_input), else None."""
        for r in self.statuses_since(since):
            failure = r.get("failure")
            if (r.get("state") == FAILED and isinstance(failure, dict)
                    and failure.get("kind") == BAD_INPUT):
                return f"rank {r.get('rank')}: {failure.get('message')}"
        return None

    def statuses_since(self, since: float) -> list[dict[str, Any]]:
        """The statuses of ranks started at ``since`` or later (this host's clock)."""
        return [r for r in self.statuses().records
                if isinstance(r.get("started_at"), (int, float)) and r["started_at"] >= since]

    def status_folder(self, skipped: list[Skipped]) -> RunFolder | None:
        """The status folder, listed (close it after use); None when there is none or it
        cannot be read, which is added to ``skipped``."""
        try:
            return RunFolder(self.status_dir, self.root)
        except PermissionError:  # glob would hide it: zero ranks that are really unseen
            skipped.append(Skipped(str(self.status_dir), "status folder not readable "
                                   "(permission denied)", code="permission_denied"))
        except SkippedFile as exc:
            skipped.append(Skipped(exc.path, exc.detail, code=exc.reason))
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as exc:
            skipped.append(Skipped(str(self.status_dir), f"status folder unreadable "
                                   f"({exc.strerror or exc})", code="unreadable"))
        return None

    def status_files(self, folder: RunFolder) -> list[str]:
        """The paths of the status files listed in ``folder``, sorted (plain strings: this
        runs every second per rank)."""
        return [os.path.join(folder.path, n)
                for n in sorted(fnmatch.filter(folder.entries, STATUS_FILE_GLOB))]

    def read_status(self, path: str, folder: RunFolder | None = None) -> dict[str, Any]:
        """One status file (listed in ``folder`` when given): SkippedFile when unusable,
        FormatError when it vanished."""
        return check_status(read_record(path, STATUS_FORMAT, root=self.root, folder=folder),
                            path)

    # journal -----------------------------------------------------------------
    def append_event(self, event: str, source: str, **fields: Any) -> dict[str, Any]:
        # ``mono``/``boot``: the writer's monotonic clock beside its wall clock, so a reader
        # can place events of processes whose wall clocks disagree (report/clocks.py).
        record = {"v": FORMAT_VERSION, "time": time.time(), "mono": time.monotonic(),
                  "event": event, "source": source, "host": node_name(), "boot": boot_id(),
                  **fields}
        append_jsonl(self.journal_file, record)
        return record

    def journal(self) -> ReadResult:
        return read_jsonl(self.journal_file, self.root)

    def events(self, *names: str) -> list[dict[str, Any]]:
        """Journal records, optionally only those with the given event names."""
        records = self.journal().records
        return [r for r in records if not names or r.get("event") in names]

    def log_text(self, name: str, max_bytes: int = 16 << 20) -> str:
        """The end of ``logs/<name>`` as text (torchrun's log, the job's); OSError or
        FormatError (a special file, a symlink out) when it cannot be read safely."""
        return read_run_file_tail(self.logs_dir / name, self.root,
                                  max_bytes=max_bytes).decode("utf-8", "replace")

    # per-step metrics ----------------------------------------------------------
    def metrics(self, rank: int = 0) -> ReadResult:
        return read_jsonl(self.metrics_file(rank), self.root)

    def ranks_with_metrics(self) -> list[int]:
        ranks = [rank_of_file(path) for path in self.metrics_dir.glob(METRICS_FILE_GLOB)]
        return sorted(r for r in ranks if r is not None)


def iter_run_dirs(folder: str | Path) -> Iterator[RunDir]:
    """Run directories directly inside ``folder`` (for agents on nodes hosting several jobs)."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for child in sorted(folder.iterdir()):
        run = RunDir(child)
        if run.status_dir.is_dir() or run.run_file.exists():
            yield run


def pick_run_dir(argument: str | Path | None, option: str | Path | None,
                 default: str | Path | None = None) -> Path:
    """The run directory of a command, given as RUN_DIR or as --run-dir: every command
    takes both, so users need not remember which one a command wants."""
    if argument is not None and option is not None and Path(argument) != Path(option):
        raise ConfigError(f"two run directories given ({argument} and --run-dir {option}); "
                          "give one")
    chosen = argument if argument is not None else option if option is not None else default
    if chosen is None:
        raise ConfigError("no run directory given: pass RUN_DIR (or --run-dir RUN_DIR)")
    return Path(chosen)
