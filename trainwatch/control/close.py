"""``trainwatch close``: end a run whose job is gone and that nobody will resume here.

A node that rebooted (or a job abandoned without its supervisor) leaves its ranks'
statuses saying ``running`` with their processes gone: the agent keeps exporting them as
down and TrainingRankDown pages, and Alertmanager repeats it, for as long as the run
directory stays where the agent looks. Closing journals ``run_closed``; the agent and
diagnose then treat the run as stopped (no page) until a new start. It refuses while
anything could still be the job: a supervisor holding the run, a rank process alive on
this host, a rank on another node that beat recently.
"""

from __future__ import annotations

import getpass
import os
import time
from typing import Any

import click

from trainwatch.rundir.beat import beat_path, merge_beat, read_beat
from trainwatch.config.clitypes import run_dir_option
from trainwatch.contract.env import DEFAULT_RUN_DIR, RUN_DIR_ENV, SUPERVISOR_ENV, run_dir_from_env
from trainwatch.contract.layout import CLOSED_EVENT
from trainwatch.errors import ConfigError
from trainwatch.host.procinfo import still_running
from trainwatch.invocation import program
from trainwatch.node import boot_id, node_name
from trainwatch.process.proctree import marked
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.runlock import acquire

# A rank on another node whose process cannot be looked at must have been silent this long
# (its heartbeat is every second or so): a job alive there is never closed from here.
REMOTE_QUIET_SECONDS = 600.0


def _when(t: float, now: float) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t))
    return f"{stamp}, {(now - t) / 3600:.1f} h ago" if now - t >= 3600 \
        else f"{stamp}, {now - t:.0f} s ago"


def _user() -> str:
    """Who closed it: a container's uid may have no name (getpass then raises)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"


def _alive_here(status: dict[str, Any]) -> bool:
    """Does the rank's process still (or may it) run on this host, in this boot?"""
    return status.get("boot") == boot_id() and bool(still_running(status))


def check_gone(run: RunDir, now: float) -> tuple[list[dict[str, Any]], list[str]]:
    """The ranks' statuses (brought up to date by their beat files) and the reasons the run
    may not be closed (empty: its job is gone)."""
    here = {node_name()}
    ranks, refusals = [], []
    for status in run.statuses().records:
        status, _ = merge_beat(status, read_beat(beat_path(run.status_dir, status["rank"]),
                                                 run.root))
        ranks.append(status)
        rank, node, beat = status["rank"], status.get("node"), status.get("heartbeat_at")
        if node in here or status.get("boot") == boot_id():
            if _alive_here(status):
                refusals.append(f"rank {rank} (pid {status.get('pid')}) is still running here:"
                                " stop the job first (Ctrl-C its trainwatch run, or SIGTERM"
                                " its launcher)")
        elif isinstance(beat, (int, float)) and now - beat < REMOTE_QUIET_SECONDS:
            refusals.append(f"rank {rank} on node {node} beat {now - beat:.0f} s ago and its "
                            f"process cannot be checked from here: close it when it has "
                            f"been silent for {REMOTE_QUIET_SECONDS:.0f} s")
    return ranks, refusals


@click.command("close")
@run_dir_option("The run directory to close (or give it as RUN_DIR).", argument=True,
                show_default=f"${RUN_DIR_ENV} or ./{DEFAULT_RUN_DIR}")
@click.option("--reason", default="its job is gone", show_default=True,
              help="Why, recorded in the journal.")
def close(run: RunDir | None, reason: str) -> None:
    """Mark a run whose job is gone (a node rebooted, the job was abandoned) as stopped,
    so it pages nobody until it is started again.

    Refuses (exit 2) while a supervisor holds the run or a rank's process may still run.
    """
    run = run if run is not None else RunDir(run_dir_from_env())
    if not run.exists() or not (run.status_dir.is_dir() or run.run_file.exists()):
        raise ConfigError("not a trainwatch run directory (no status/ and no run.json)",
                          file=str(run.root))
    lock = acquire(run, "trainwatch close")  # a supervisor holding the run: refused here
    try:
        previous = lock.previous
        now = time.time()
        ranks, refusals = check_gone(run, now)
        if previous is not None and previous.here() \
                and (left := marked(SUPERVISOR_ENV, previous.token)):
            refusals.append(f"processes of its last supervisor ({previous.describe()}) still "
                            f"run: pids {[p.pid for p in left]}")
        if refusals:
            raise ConfigError("not closed: " + "; ".join(refusals), file=str(run.root))
        beats = [s["heartbeat_at"] for s in ranks
                 if isinstance(s.get("heartbeat_at"), (int, float))]
        rebooted = any(s.get("boot") and s.get("node") == node_name()
                       and s.get("boot") != boot_id() for s in ranks)
        try:
            run.append_event(CLOSED_EVENT, "close", reason=reason, user=_user(),
                             last_heartbeat_at=max(beats, default=None), rebooted=rebooted,
                             states={str(s["rank"]): s.get("state") for s in ranks})
        except OSError as exc:  # whole lines or none: nothing was recorded, nothing closed
            raise ConfigError(f"not closed: cannot journal {CLOSED_EVENT}: "
                              f"{exc.strerror or exc}", file=str(run.journal_file)) from None
    finally:
        lock.release()
    last = f"; last heartbeat {_when(max(beats), now)}" if beats else ""
    click.echo(f"trainwatch close: {run.root}: closed ({reason}{last}"
               f"{'; this node rebooted since' if rebooted else ''}). The agent treats it as "
               "stopped and nothing pages for it until it is started again: "
               f"{program()} run --run-dir {run.root} ... resumes it from its newest "
               "verified checkpoint.")
