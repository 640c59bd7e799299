"""The supervisor drills' fault: what the drill itself does to ``trainwatch run`` once the job
reaches the fault step. ``kill``: SIGKILL it, wait for every process it started to end by
itself, then run the same command again. ``second``: start the same command beside it,
which must exit 2 at once naming the holder. What the drill saw goes into the run's journal
(source ``drill``), where the scorer reads it as detection signals."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psutil

from trainwatch.drill.catalog import KILL_SUPERVISOR, Drill
from trainwatch.drill.runner import stop_tree
from trainwatch.process.proctree import wait_gone
from trainwatch.errors import FormatError
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.safe_read import read_run_file_tail

TREE_WAIT_SECONDS = 60.0     # a killed supervisor's job stops gracefully (ranks checkpoint)
SECOND_WAIT_SECONDS = 60.0   # a refused second supervisor exits long before this
SECOND_LOG_TAIL_BYTES = 64 * 1024


class SupervisorFault:
    def __init__(self, drill: Drill, run: RunDir, cmd: list[str], env: dict[str, str],
                 log: Path):
        self.drill, self.run, self.cmd, self.env, self.log = drill, run, cmd, env, log
        self.done = False
        self.left: list[psutil.Process] = []  # what outlived the kill: stopped at the end

    def check(self, proc: subprocess.Popen) -> subprocess.Popen:
        """Act once the job reached the fault step; the process to watch from now on."""
        step = self._step()
        if self.done or step is None or step < self.drill.fault_step:
            return proc
        self.done = True
        if self.drill.supervisor_fault == KILL_SUPERVISOR:
            return self._kill(proc, step)
        self._second(proc, step)
        return proc

    def _kill(self, proc: subprocess.Popen, step: int) -> subprocess.Popen:
        try:
            tree = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        self.run.append_event("fault_injected", "drill", fault=self.drill.fault_kind,
                              step=step, pid=proc.pid, processes=len(tree))
        proc.kill()
        proc.wait()
        killed = time.time()
        self.left = wait_gone(tree, TREE_WAIT_SECONDS)
        if self.left:
            self.run.append_event("supervisor_tree_left", "drill",
                                  pids=[p.pid for p in self.left],
                                  seconds=round(time.time() - killed, 3))
        else:
            self.run.append_event("supervisor_tree_gone", "drill", processes=len(tree),
                                  seconds=round(time.time() - killed, 3))
        with open(self.log, "ab") as log:  # the same command again, as an operator would
            return subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=self.env,
                                    start_new_session=True)

    def _second(self, proc: subprocess.Popen, step: int) -> None:
        self.run.append_event("fault_injected", "drill", fault=self.drill.fault_kind,
                              step=step, holder=proc.pid)
        out = self.run.drill_second_log
        started = time.time()
        with open(out, "wb") as log:
            second = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=self.env,
                                      start_new_session=True)
        try:
            code: int | None = second.wait(timeout=SECOND_WAIT_SECONDS)
        except subprocess.TimeoutExpired:  # it did not refuse: stop it and all it started
            stop_tree(second)
            code = None
        try:  # its refusal is a line or two; a runaway one is not read whole
            text = read_run_file_tail(out, self.run.root, max_bytes=SECOND_LOG_TAIL_BYTES
                                      ).decode(errors="replace")
        except (OSError, FormatError):
            text = ""
        self.run.append_event("second_supervisor_exited", "drill", exit_code=code,
                              named_holder=f"pid {proc.pid}" in text,
                              seconds=round(time.time() - started, 3))

    def stop_left(self) -> None:
        """Never leave anything running: what outlived the kill, by pid."""
        for p in wait_gone(self.left, 0):
            try:
                p.kill()
            except psutil.Error:
                pass

    def _step(self) -> int | None:
        steps = [s["step"] for s in self.run.statuses().records
                 if isinstance(s.get("step"), int)]
        return max(steps) if steps else None
