"""The job controller: runs the training job as a subprocess and stops/restarts it.

It drives ``trainwatch train`` (or any command that resumes from the run
directory's newest verified checkpoint on start) and knows nothing about alerts;
``control/actions.py`` decides when to call it.  Stopping kills the whole process
tree (launcher, torchrun, ranks): gracefully (SIGTERM, then SIGKILL) or at once for
hung or diverged jobs, so a frozen (SIGSTOPped) rank cannot keep a restart waiting.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from trainwatch.config.clitypes import MAX_RESTARTS
from trainwatch.control.job_output import JobOutput
from trainwatch.control.jobenv import job_environment
from trainwatch.contract.env import LAUNCH_ENV
from trainwatch.contract.layout import (CONTROL_DUMP, DUMP_FILE_GLOB, JOB_LOG,
                                        JOB_LOG_ATTEMPT_LINE, JOB_LOG_STOPPED_LINE,
                                        RANK_PREFIX,
                                        STATUS_FILE_GLOB, py_spy_file_name)
from trainwatch.node import node_name
from trainwatch.process.proctree import spawn, wait_gone
from trainwatch.errors import FormatError
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.safe_read import read_run_file

log = logging.getLogger(__name__)

# The job's start number (1, 2, ...), for fault drills: trainwatch.trainer.faults reads it
# (``launch=N``), so a drill's fault fires in the first start only.


def train_command(run_dir: str | Path, nproc_per_node: int, *, config: str | None = None,
                  steps: int | None = None, overrides: Sequence[str] = (),
                  max_restarts: int = MAX_RESTARTS,
                  rendezvous: Sequence[str] = ()) -> list[str]:
    """The ``trainwatch train`` command line the controller runs (the trainer's launcher);
    ``rendezvous``: a multi-node job's options (``--nnodes``, ``--node-rank``, ...), the
    same at every start of this node's launcher."""
    cmd = [sys.executable, "-m", "trainwatch", "train", "--run-dir", str(run_dir),
           "--nproc-per-node", str(nproc_per_node), "--max-restarts", str(max_restarts),
           *rendezvous]
    if config:
        cmd += ["--config", str(config)]
    if steps is not None:
        cmd += ["--set", f"train.steps={steps}"]
    for override in overrides:
        cmd += ["--set", override]
    return cmd


class ControllerClosed(RuntimeError):
    """A start asked of a controller that was closed (the controller is shutting down)."""


class JobController:
    """Start, stop and restart one job; observe its progress through the run directory."""

    def __init__(self, run: RunDir | str | Path, command: list[str], *,
                 env: dict[str, str] | None = None, stop_grace_seconds: float = 15.0):
        # a path: a caller outside control/ (a test, a script) that has no RunDir at hand
        self.run = (run if isinstance(run, RunDir) else RunDir(run)).create()
        self.command = list(command)
        self.env = env
        self.stop_grace = stop_grace_seconds
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.started_at: float | None = None
        self.stopping = False
        self.closed = False  # close(): nothing starts again, not even a restart under way
        self.lock = threading.RLock()
        self.extra_args: list[str] = []
        self.unrecorded: list[str] = []  # events a full or failing disk kept out of the journal
        self.exit_journaled: int | None = None  # the pid whose own exit is in the journal
        self.output = JobOutput(self.run.logs_dir / JOB_LOG, on_failing=self._output_failing)
        # Where the output stood when the current start began: its own part and losses.
        self._start_mark, self._start_dropped = 0, 0
        # One node of a multi-node job: evidence is taken of this node's ranks only (the
        # others' pids name processes of other machines).
        self.node_only = False

    # ------------------------------------------------------------------ lifecycle
    def start(self, reason: str = "start") -> int:
        with self.lock:
            if self.closed:
                raise ControllerClosed(f"not starting the job ({reason}): the controller is closed")
            # The job's stdout is a pipe the supervisor drains into logs/job.log, best
            # effort (control/job_output.py): a full disk there costs lines, never the job.
            self.output.drain()  # the previous start's output comes first
            env = {**job_environment(self.env), LAUNCH_ENV: str(self.starts + 1)}
            self.output.write(JOB_LOG_ATTEMPT_LINE.format(
                attempt=self.starts + 1, reason=reason,
                time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())).encode())
            self._start_mark = self.output.position
            self._start_dropped = self.output.dropped_bytes
            read_fd, write_fd = self.output.pipe()
            try:
                # spawn: the job gets SIGTERM if this process dies (a killed supervisor
                # leaves no job behind), whichever thread starts it. It keeps the pipe's
                # read end: with us gone its writes fill the pipe, never fail (EPIPE).
                self.proc = spawn(self.command + self.extra_args, env=env, stdout=write_fd,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  pass_fds=(read_fd,), start_new_session=True)
            except BaseException:
                os.close(read_fd)
                raise
            finally:
                os.close(write_fd)
            self.output.pump(read_fd, name=f"tw-job-output-{self.starts + 1}")
            self.starts += 1
            self.started_at = time.time()
            self.stopping = False
            self.journal("job_started", pid=self.proc.pid, reason=reason, attempt=self.starts,
                         command=self.command + self.extra_args)
            return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, reason: str, *, hard: bool = False) -> int | None:
        """Stop the job's whole process tree.

        Graceful (SIGTERM to the launcher, the ranks checkpoint; SIGKILL after the grace) unless
        ``hard``: a hung job cannot finish a checkpoint, and a diverged one must not write
        one, so those are killed at once (SIGKILL also ends SIGSTOPped processes).
        """
        with self.lock:
            if self.proc is None:
                return None
            code = self.proc.poll()
            if code is not None:  # it exited by itself: say so (once), nothing was stopped
                self.journal_exit(self.proc.pid, code)
                return code
            self.stopping = True
            tree = self._tree()
            descendants = [p for p in tree if p.pid != self.proc.pid]
            leftover = descendants
            if not hard:
                # SIGTERM to the launcher only: it forwards it to torchrun, which stops the
                # ranks in order (they checkpoint); signalling every process at once races
                # torchrun's teardown against the ranks' last collective.
                self.proc.send_signal(signal.SIGTERM)
                for p in tree:
                    _signal(p, signal.SIGCONT)  # a stopped process must run to stop
                try:  # the launcher is our child: Popen reaps it and keeps its exit code
                    self.proc.wait(timeout=self.stop_grace)
                except subprocess.TimeoutExpired:
                    pass
                leftover = wait_gone(descendants, timeout=1)
            killed = [p.pid for p in leftover]
            if self.proc.poll() is None:
                self.proc.kill()
                killed.insert(0, self.proc.pid)
            for p in leftover:
                _signal(p, signal.SIGKILL)
            code = self.proc.wait()
            wait_gone(leftover, timeout=5)
            self._log_stop(reason)
            self.journal("job_stopped", pid=self.proc.pid, reason=reason, returncode=code,
                         hard=hard, killed=killed)
            return code

    def kill_ranks(self, before: float) -> list[int]:
        """SIGKILL this node's rank processes of the job (a status file names them and they
        are in the job's process tree), with their children, and leave the launcher and
        torchrun running: a multi-node job's repair (control/repairs.py). SIGKILL also ends
        a SIGSTOPped rank. Only ranks started before ``before``: those torchrun started
        since are the repaired job's. Returns the pids killed."""
        with self.lock:
            tree = {p.pid: p for p in self._tree()}
        victims: list[psutil.Process] = []
        for status in self.run.statuses().records:
            proc = tree.get(status.get("pid"))  # type: ignore[arg-type]
            if proc is None or proc in victims:
                continue
            try:
                if proc.create_time() > before:
                    continue
                victims += [proc, *proc.children(recursive=True)]
            except psutil.Error:
                continue
        for proc in victims:
            _signal(proc, signal.SIGKILL)
        wait_gone(victims, timeout=5)
        return sorted(p.pid for p in victims)

    def _log_stop(self, reason: str) -> None:
        """Say in the job's log, after its last output, that trainwatch stopped it (best
        effort: a full disk costs the line, never the stop)."""
        self.output.drain()
        self.output.write(JOB_LOG_STOPPED_LINE.format(
            attempt=self.starts, reason=reason,
            time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())).encode())

    def _output_failing(self, error: str) -> None:
        """The job's log stopped taking its output: journaled once per spell, when it can be."""
        self.journal("job_output_dropped", path=str(self.output.log.path), error=error)

    def journal_exit(self, pid: int, code: int, **fields: Any) -> None:
        """Journal ``job_exited`` for the job's exit by itself, once per process: the
        supervisor's look and an action that came to stop it may both notice it."""
        with self.lock:
            if self.exit_journaled == pid:
                return
            self.exit_journaled = pid
            self.output.drain()  # its last words are in the log (and the tail) first
            lost = self.output.dropped_bytes - self._start_dropped
            if code and lost:  # the log lacks some of what it said: its last words here
                fields.update(output_dropped_bytes=lost, last_words=self.last_words())
            self.journal("job_exited", returncode=code, pid=pid, **fields)

    def last_words(self) -> str:
        """The last lines the current (or last) start wrote, from the output's tail in
        memory: what the log may lack."""
        return self.output.last_words(self._start_mark)

    def journal(self, event: str, **fields: Any) -> None:
        """Journal one of the supervisor's events. A full disk costs the event (listed in
        ``unrecorded`` for the user), never the start or stop it records."""
        try:
            self.run.append_event(event, "engine", **fields)
        except OSError as exc:
            self.unrecorded.append(f"{event} ({exc.strerror or exc})")
            log.warning("could not journal %s: %s", event, exc.strerror or exc)

    def close(self, reason: str) -> None:
        """Stop the job for good: an action thread that is restarting it meanwhile starts
        nothing after this (its new processes would outlive the controller)."""
        with self.lock:
            self.closed = True
            if self.alive():
                self.stop(reason)
            self.output.drain()
            self.output.close()  # the run directory's mount is not kept busy

    def restart(self, reason: str, *, hard: bool = False) -> int:
        with self.lock:
            if self.alive():
                self.stop(reason, hard=hard)
            return self.start(reason)

    def _tree(self) -> list[psutil.Process]:
        if self.proc is None:
            return []
        try:
            root = psutil.Process(self.proc.pid)
            return [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    # ------------------------------------------------------------------ observation
    def progress_step(self) -> int | None:
        """The step a restart would resume from: the newest complete checkpoint, or the
        newest one the job declared (``Telemetry.checkpoint_saved``) that still exists.

        Forward progress means this moves; a job that crashes before its next checkpoint
        every time makes none, however many steps it trains in between.
        """
        steps = [step for step, _ in self.checkpoints()]
        steps += [step for step, _ in self.declared_checkpoints()]
        return max(steps) if steps else None

    def ranks_reported(self) -> bool:
        """Some rank of the current start wrote its status or beat file: the job got as far
        as running a rank. One that exits before that failed to launch (a missing script, a
        bad launcher option): restarting it would fail the same way."""
        if self.started_at is None:
            return False
        since = self.started_at - 0.05  # file times come from the coarser kernel clock
        try:
            with os.scandir(self.run.status_dir) as entries:
                return any(e.name.startswith(RANK_PREFIX)
                           and e.is_file(follow_symlinks=False)
                           and e.stat(follow_symlinks=False).st_mtime >= since
                           for e in entries)
        except OSError:
            return False

    def rejected_input(self) -> str | None:
        """What a rank of the current start said when it died on bad input, else None."""
        return None if self.started_at is None else self.run.rejected_input_since(
            self.started_at)

    def ranks_finished(self) -> bool:
        """Every rank of the current start wrote a ``finished`` status (``RunDir.finished_since``)."""
        return self.started_at is not None and self.run.finished_since(self.started_at)

    def resume_point(self) -> tuple[int | None, str]:
        """What a restart resumes from, as the journal may say it: ``(step, kind)`` with kind
        ``checkpoint`` (a complete trainwatch checkpoint; the job verifies its hashes when it
        resumes), ``declared`` (the job's own files, not verified by trainwatch) or ``none``."""
        declared = self.declared_checkpoints()
        # A declared directory in a checkpoint folder (a DCP save) is the job's, not ours:
        # no manifest for the job to verify as it loads.
        ours = [c for c in self.checkpoints() if c[1] not in {p for _, p in declared}]
        if ours and (not declared or ours[-1][0] >= declared[-1][0]):
            return ours[-1][0], "checkpoint"
        if declared:
            return declared[-1][0], "declared"
        return None, "none"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of complete checkpoints in every checkpoint folder, oldest first.

        From the checkpoint library's catalog when it is installed, and from the journal's
        ``checkpoint_saved`` events whose directory still exists (any trainer can write those).
        """
        folders = self.run.checkpoint_folders()
        found: dict[Path, int] = {}
        try:
            from trainwatch.checkpoint_format import catalog
        except ImportError:
            catalog = None  # type: ignore[assignment]
        if catalog is not None:
            for folder in folders:
                found.update({e.path: e.step for e in catalog.scan(folder)
                              if e.state == "complete" and e.step is not None})
        for event in self.run.events("checkpoint_saved"):
            path = Path(str(event.get("path", "")))
            if isinstance(event.get("step"), int) and path.is_dir() and path.parent in folders:
                found.setdefault(path, event["step"])
        return sorted((step, path) for path, step in found.items())

    def rank_processes(self) -> dict[int, tuple[int, int]]:
        """{rank: (pid, local rank)} of this node's ranks that are in the job's process tree
        (a status file of an earlier start names a pid that is no longer ours)."""
        with self.lock:
            tree = {p.pid for p in self._tree()} if self.proc is not None else set()
        records = self.run.statuses().records
        names = {node_name(), socket.gethostname()}
        mine = [s for s in records if s.get("node") in names] or records
        return {s["rank"]: (s["pid"], s.get("local_rank") or 0) for s in mine
                if s.get("pid") in tree}

    def declared_checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of saves the job declared itself that still exist, oldest first; a
        file saved over and over counts with its newest step."""
        found: dict[Path, int] = {}
        for event in self.run.events("checkpoint_saved"):
            step = event.get("step")
            if not event.get("declared") or isinstance(step, bool) or not isinstance(step, int):
                continue
            path = Path(str(event.get("path", "")))
            if path.exists():
                found[path] = max(step, found.get(path, step))
        return sorted((step, path) for path, step in found.items())

    def rank_pids(self) -> dict[int, int]:
        names = {node_name(), socket.gethostname()}
        return {s["rank"]: s["pid"] for s in self.run.statuses().records
                if isinstance(s.get("rank"), int) and isinstance(s.get("pid"), int)
                and (not self.node_only or s.get("node") in names)}

    # ------------------------------------------------------------------ evidence
    def capture_evidence(self, label: str, *, wait_seconds: float = 3.0) -> Path:
        """Stacks, status files and py-spy dumps into diagnostics/<label>-<time>/."""
        folder = self.run.diagnostics_dir / f"{label}-{time.strftime('%Y%m%dT%H%M%S')}"
        folder.mkdir(parents=True, exist_ok=True)
        request = self.run.control_file(CONTROL_DUMP)
        request.touch()  # ranks answer control/dump from their telemetry thread
        for path in self.run.status_dir.glob(STATUS_FILE_GLOB):
            try:  # a FIFO or a link to /dev/zero here must not hang or fill the disk
                (folder / path.name).write_bytes(read_run_file(path, self.run.root))
            except (OSError, FormatError) as exc:
                (folder / f"{path.name}.skipped").write_text(f"{exc}\n")
        pyspy = shutil.which("py-spy")
        for rank, pid in sorted(self.rank_pids().items()):
            out = folder / py_spy_file_name(rank)
            if pyspy is None:
                out.write_text("py-spy is not installed\n")
                continue
            try:
                state = psutil.Process(pid).status()
            except psutil.NoSuchProcess:
                out.write_text(f"pid {pid}: no such process\n")
                continue
            if state == psutil.STATUS_STOPPED:
                # ptrace on a stopped process waits forever; say so instead of hanging.
                out.write_text(f"pid {pid} is stopped (SIGSTOP): frozen, no stack available\n")
                continue
            try:
                res = subprocess.run([pyspy, "dump", "--pid", str(pid)], capture_output=True,
                                     text=True, timeout=20)
                out.write_text(res.stdout + res.stderr)
            except (subprocess.TimeoutExpired, OSError) as exc:
                out.write_text(f"py-spy failed: {exc}\n")
        deadline = time.time() + wait_seconds
        while time.time() < deadline:  # give live ranks a moment to answer control/dump
            dumps = list(self.run.diagnostics_dir.glob(DUMP_FILE_GLOB))
            if dumps and all(d.stat().st_mtime >= request.stat().st_mtime for d in dumps):
                break
            time.sleep(0.2)
        for dump in self.run.diagnostics_dir.glob(DUMP_FILE_GLOB):
            if dump.stat().st_mtime >= request.stat().st_mtime:
                shutil.copy2(dump, folder / dump.name)
        return folder


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass
