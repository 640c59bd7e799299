"""The run directory: the one place a run leaves its state.

Layout and record formats are documented in docs/run-directory.md and are
versioned (``FORMAT_VERSION``).  Every writer here writes atomically (temp
file + rename) or appends whole lines; every reader tolerates torn, empty,
alien or future-version files by skipping them and saying why.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from trainwatch.errors import ConfigError, FormatError
from trainwatch.node import node_name

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
STATUS_FORMAT = "trainwatch.status"
RUN_FORMAT = "trainwatch.run"

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
)


# --------------------------------------------------------------------------- writing

def atomic_write_bytes(path: str | Path, data: bytes, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` so readers see the old or new file, never a torn one.

    ``durable`` also fsyncs the file and its directory, so the new content survives a
    power cut; heartbeats skip that (a lost heartbeat is harmless, fsync is not free).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
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


def fsync_dir(path: str | Path) -> None:
    """fsync a directory so a rename inside it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: str | Path, obj: Any, *, durable: bool = True) -> None:
    atomic_write_bytes(path, (json.dumps(obj, separators=(",", ":")) + "\n").encode(),
                       durable=durable)


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """Append one JSON line with a single O_APPEND write (whole lines, even with many writers)."""
    data = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- reading

@dataclass
class Skipped:
    """A file or line a reader could not use, and why (shown to users, counted by the agent)."""

    path: str
    reason: str
    line: int | None = None

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line else self.path
        return f"{where}: {self.reason}"


@dataclass
class ReadResult:
    records: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)


def read_record(path: str | Path, expected_format: str) -> dict[str, Any]:
    """Read one versioned JSON document; raise FormatError saying what is wrong with it."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise FormatError(f"{path}: missing") from None
    except OSError as exc:
        raise FormatError(f"{path}: unreadable ({exc.strerror})") from None
    if not raw.strip():
        raise FormatError(f"{path}: empty file")
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatError(f"{path}: torn or not JSON ({exc})") from None
    return check_format(obj, expected_format, str(path))


def check_format(obj: Any, expected_format: str, where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise FormatError(f"{where}: not a JSON object")
    fmt, version = obj.get("format"), obj.get("version")
    if fmt != expected_format:
        raise FormatError(f"{where}: not a {expected_format} file (format={fmt!r})")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise FormatError(f"{where}: {expected_format} version {version!r} is not supported "
                          f"(this trainwatch reads version {FORMAT_VERSION})")
    return obj


def parse_jsonl_line(line: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """One JSON-lines record, or why it is skipped; ``(None, None)`` for a blank line.

    The one definition of a torn or alien line, shared by ``read_jsonl`` and the agent's
    incremental journal reader.
    """
    if not line.strip():
        return None, None
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        # A torn last line is what a crash mid-append leaves; say so plainly.
        return None, "torn or not JSON"
    if not isinstance(obj, dict):
        return None, "not a JSON object"
    version = obj.get("v", 1)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        return None, f"record version {version!r} not supported"
    return obj, None


def read_jsonl(path: str | Path) -> ReadResult:
    """Read a JSON-lines file, skipping (and reporting) torn or alien lines."""
    result = ReadResult()
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return result
    except OSError as exc:
        result.skipped.append(Skipped(str(path), f"unreadable ({exc.strerror})"))
        return result
    with fh:
        for lineno, line in enumerate(fh, 1):
            obj, reason = parse_jsonl_line(line)
            if reason is not None:
                result.skipped.append(Skipped(str(path), reason, lineno))
            elif obj is not None:
                result.records.append(obj)
    return result


# --------------------------------------------------------------------------- the directory

class RunDir:
    """Paths and typed access to one run directory (see docs/run-directory.md)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    # paths -----------------------------------------------------------------
    @property
    def run_file(self) -> Path:
        return self.root / "run.json"

    @property
    def journal_file(self) -> Path:
        return self.root / "journal.jsonl"

    @property
    def status_dir(self) -> Path:
        return self.root / "status"

    @property
    def metrics_dir(self) -> Path:
        return self.root / "metrics"

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def diagnostics_dir(self) -> Path:
        return self.root / "diagnostics"

    @property
    def control_dir(self) -> Path:
        return self.root / "control"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def tmp_dir(self) -> Path:
        return self.root / "tmp"

    def status_file(self, rank: int) -> Path:
        return self.status_dir / f"rank-{rank:05d}.json"

    def metrics_file(self, rank: int) -> Path:
        return self.metrics_dir / f"rank-{rank:05d}.jsonl"

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
            return read_record(self.run_file, RUN_FORMAT)
        except FormatError as exc:
            if self.run_file.exists():
                log.warning("%s", exc)
            return None

    # per-rank status ---------------------------------------------------------
    def write_status(self, rank: int, status: dict[str, Any]) -> None:
        atomic_write_json(self.status_file(rank),
                          {"format": STATUS_FORMAT, "version": FORMAT_VERSION, **status},
                          durable=False)

    def statuses(self) -> ReadResult:
        """Every rank's status, newest format only; torn/alien files are skipped and listed."""
        result = ReadResult()
        if not self.status_dir.is_dir():
            return result
        for path in sorted(self.status_dir.glob("rank-*.json")):
            try:
                result.records.append(read_record(path, STATUS_FORMAT))
            except FormatError as exc:
                result.skipped.append(Skipped(str(path), str(exc).split(": ", 1)[-1]))
        return result

    # journal -----------------------------------------------------------------
    def append_event(self, event: str, source: str, **fields: Any) -> dict[str, Any]:
        record = {"v": FORMAT_VERSION, "time": time.time(), "event": event, "source": source,
                  "host": node_name(), **fields}
        append_jsonl(self.journal_file, record)
        return record

    def journal(self) -> ReadResult:
        return read_jsonl(self.journal_file)

    def events(self, *names: str) -> list[dict[str, Any]]:
        """Journal records, optionally only those with the given event names."""
        records = self.journal().records
        return [r for r in records if not names or r.get("event") in names]

    # per-step metrics ----------------------------------------------------------
    def metrics(self, rank: int = 0) -> ReadResult:
        return read_jsonl(self.metrics_file(rank))

    def ranks_with_metrics(self) -> list[int]:
        ranks = []
        for path in self.metrics_dir.glob("rank-*.jsonl"):
            try:
                ranks.append(int(path.stem.split("-", 1)[1]))
            except ValueError:
                continue
        return sorted(ranks)


def iter_run_dirs(folder: str | Path) -> Iterator[RunDir]:
    """Run directories directly inside ``folder`` (for agents on nodes hosting several jobs)."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for child in sorted(folder.iterdir()):
        if (child / "status").is_dir() or (child / "run.json").exists():
            yield RunDir(child)


def pick_run_dir(argument: str | Path | None, option: str | Path | None,
                 default: str | Path | None = None) -> Path:
    """The run directory of a reading command, given as RUN_DIR or as --run-dir.

    Commands that create a run take ``--run-dir``, those that read one a positional
    RUN_DIR; users type either, so the readers accept both.
    """
    if argument is not None and option is not None and Path(argument) != Path(option):
        raise ConfigError(f"two run directories given ({argument} and --run-dir {option}); "
                          "give one", key="RUN_DIR")
    chosen = argument if argument is not None else option if option is not None else default
    if chosen is None:
        raise ConfigError("no run directory given: pass RUN_DIR (or --run-dir RUN_DIR)",
                          key="RUN_DIR")
    return Path(chosen)
