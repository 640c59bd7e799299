"""A user's own launch command under the job controller (``trainwatch run -- COMMAND``).

Any command works (``torchrun --nproc-per-node 4 train.py``, ``python train.py``, a
Lightning or Hugging Face script) if it keeps the contract in docs/own-trainer.md: it
publishes telemetry into ``$TRAINWATCH_RUN_DIR`` and resumes from the newest verified
checkpoint when started again. What is checked before anything starts, the environment
the job receives, ``run.json``, and the warning for a job that never reports in are here;
restarts, rollbacks and the guard are the controller's and the action runner's, the
same as for the reference trainer. ``alerts receive --job-command`` uses this too.
"""

from __future__ import annotations

import os
import shlex
import shutil
import threading
import time
from typing import Callable

from trainwatch import __version__
from trainwatch.control.controller import JobController
from trainwatch.contract.env import JOB_ENV, NODE_ENV, RUN_DIR_ENV
from trainwatch.contract.layout import JOB_LOG, STATUS_FILE_GLOB
from trainwatch.errors import ConfigError
from trainwatch.node import node_name
from trainwatch.rundir.run_dir import RunDir
from trainwatch.trainer.rendezvous import pin_standalone

# Seconds a started job may go without any rank publishing telemetry before `run` says so.
TELEMETRY_GRACE_SECONDS = 45.0


def resolve(command: list[str]) -> list[str]:
    """The command with its program found on PATH; ConfigError (exit 2) naming it if not."""
    if not command or not command[0]:
        raise ConfigError("no command given after --", key="COMMAND")
    program = command[0]
    found = shutil.which(program)
    if found is None:
        where = "is not an executable file" if os.sep in program else "was not found on PATH"
        raise ConfigError(f"{program!r} {where}{_script_hint(command)}", key="COMMAND")
    return list(command)


def _script_hint(command: list[str]) -> str:
    """A Python script given as the program: say how to start it, the mistake is common."""
    if not command[0].endswith(".py"):
        return ""
    args = shlex.join(command)
    return (f"; start the script with its interpreter or launcher: `-- python {args}` or "
            f"`-- torchrun --standalone --nproc-per-node N {args}`")


def job_env(run: RunDir, base: dict[str, str] | None = None) -> dict[str, str]:
    """What the job's processes receive (docs/own-trainer.md): the run directory, the job
    name, the node name, and torch settings restarts need; a user's own values win."""
    env = dict(os.environ if base is None else base)
    env[RUN_DIR_ENV] = str(run.root.resolve())
    env[JOB_ENV] = run.run_name(env.get(JOB_ENV))  # the run.json name wins
    env.setdefault(NODE_ENV, node_name())
    # torchrun --max-restarts with gloo on torch 2.13 re-rendezvous only without the shared store.
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    # The last collectives, for `trainwatch diagnose` on a hung rank.
    env.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    return env


def describe_run(run: RunDir, command: list[str], supervisor: str) -> None:
    """run.json for a supervised command: the command and when the run started (the job's
    rank 0 adds the world size when its telemetry starts)."""
    previous = run.run_info() or {}
    keep = {k: v for k, v in previous.items()
            if k in ("created_at", "world_size", "checkpoint", "started_at")}
    run.write_run_info({"job": run.run_name(os.environ.get(JOB_ENV)), "created_at": time.time(),
                        "started_at": time.time(), **keep, "command": list(command),
                        "supervisor": supervisor, "trainwatch_version": __version__})


def supervised_job(run: RunDir, command: list[str], supervisor: str) -> JobController:
    """A JobController for ``command``: checked, with the job's environment and run.json."""
    command = resolve(command)
    run.create()
    describe_run(run, command, supervisor)
    env = job_env(run)
    pin_standalone(command, env)  # `torchrun --standalone`: loopback, not the hostname
    return JobController(run, command, env=env)


class TelemetryWatch:
    """Says (once per start) when the job has run ``grace`` seconds with no rank publishing
    telemetry: alerts, stall detection and restarts are blind to such a job, and waiting
    in silence would hide it. It only reports; the job keeps running."""

    def __init__(self, controller: JobController, say: Callable[[str], None], *,
                 grace: float = TELEMETRY_GRACE_SECONDS, poll: float = 1.0):
        self.controller, self.say, self.grace, self.poll = controller, say, grace, poll
        self._stop = threading.Event()
        self._warned_start = 0
        self._thread = threading.Thread(target=self._loop, name="tw-telemetry-watch",
                                        daemon=True)

    def start(self) -> "TelemetryWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def check(self, now: float | None = None) -> bool:
        """True when it warned (now) about the current start."""
        ctl = self.controller
        started_at = ctl.started_at
        if (not ctl.alive() or started_at is None or self._warned_start == ctl.starts
                or (now or time.time()) - started_at < self.grace):
            return False
        if _published_since(ctl.run, started_at):
            return False
        self._warned_start = ctl.starts
        self.say(f"trainwatch run: no rank has published telemetry {self.grace:.0f}s after the "
                 f"job started (nothing in {ctl.run.status_dir}/): until one does, alerts, "
                 "stall detection and automatic restarts cannot see the job. Still starting "
                 "(imports, data)? Then this clears itself. Otherwise: does it call "
                 "`Telemetry.from_env().start()` on every rank (docs/own-trainer.md)? "
                 f"Its output is in {ctl.run.logs_dir / JOB_LOG}.")
        ctl.run.append_event("job_silent", "engine", seconds=self.grace, attempt=ctl.starts)
        return True

    def _loop(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self.check()
            except OSError:
                pass


def _published_since(run: RunDir, since: float) -> bool:
    try:
        return any(p.stat().st_mtime >= since for p in run.status_dir.glob(STATUS_FILE_GLOB))
    except OSError:
        return False
