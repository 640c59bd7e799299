"""The run directory: the one place a run leaves its state.

Layout and record formats are documented in docs/run-directory.md and are
versioned (``FORMAT_VERSION``).  ``RunDir`` reads and writes one run directory through the
room's writers (``atomic``) and readers (``safe_read``, ``jsonl``).
"""

from __future__ import annotations

import fnmatch
import logging
import errno
import os
import time
from pathlib import Path
from typing import Any, Iterator

from trainwatch.contract.layout import (CHECKPOINT_DIRS_KEY, CLOSED_EVENT, FORMAT_VERSION,
                                       METRICS_FILE_GLOB, RUN_FORMAT, STATUS_FILE_GLOB,
                                       STATUS_FORMAT, RunLayout, rank_of_file)
from trainwatch.contract.states import BAD_INPUT, FAILED, FINISHED
from trainwatch.errors import ConfigError, FormatError
from trainwatch.node import boot_id, node_name
from trainwatch.rundir.atomic import append_jsonl, atomic_write_json
from trainwatch.rundir.jsonl import read_jsonl
from trainwatch.rundir.safe_read import (ReadResult, RunFolder, Skipped, SkippedFile, check_status, read_record,
                                        read_run_file_tail)

log = logging.getLogger(__name__)

# Journal event names written by trainwatch itself.  Readers must accept
# names they do not know (newer writers may add some).
EVENTS = (
    "run_started", "rank_started", "step_milestone", "validation", "finished", "failed",
    "restarted", "launcher_started", "launcher_exited",
    "checkpoint_saved", "checkpoint_failed", "checkpoint_skipped", "checkpoint_pruned",
    "checkpoint_fallback", "checkpoint_resumed", "checkpoint_resharded", "checkpoint_requested",
    "memory_snapshots_started", "memory_snapshots_off", "memory_snapshot_skipped",
    "memory_snapshot_rejected", "memory_snapshot_gasp", "memory_snapshots_cadence",
    "gasp_requested", "gasp_answered",
    "nonfinite_detected", "data_skipped", "fault_injected",
    "alert_firing", "alert_resolved", "action_taken", "action_skipped", "action_guard_cleared",
    "diagnostics_dumped",
    "job_started", "job_stopped", "job_exited", "job_silent", "job_output_dropped",
    "controller_started", "controller_stopping", "controller_stopped",
    "leftovers_stopped", "leftovers_unchecked",
    "repair_proposed", "repair_requested", "repair_applied", "node_lost", "node_returned",
    "supervisor_died", "supervisor_tree_gone", "supervisor_tree_left", "second_supervisor_exited", CLOSED_EVENT,
)



# --------------------------------------------------------------------------- the directory

class RunDir(RunLayout):
    """Typed reading and writing of one run directory (paths: ``RunLayout``)."""

    # setup -------------------------------------------------------------------
    def create(self) -> "RunDir":
        """Create the layout; an unwritable location is a ConfigError (exit 2). A layout
        that is all there on a full disk (its space or inodes spent: a restarted rank's
        case) is not: its writers count what the disk refuses, and the job goes on."""
        folders = (self.root, self.status_dir, self.metrics_dir, self.checkpoint_dir,
                   self.diagnostics_dir, self.control_dir, self.logs_dir, self.tmp_dir)
        try:
            for d in folders:
                d.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".write-probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT) and all(d.is_dir() for d in folders):
                return self
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
