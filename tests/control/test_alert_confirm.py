"""The controller's own look before a stall action: real processes, real beat files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from agent_helpers import wait_for

from trainwatch.control.confirm import confirm_stall
from trainwatch.rundir.run_dir import RunDir

# A "rank": writes its status once (then its disk is "full"), and beats in place; it
# steps every 0.1 s unless told to hang (asleep) or to work without stepping (busy: an
# evaluation no phase declares), optionally inside a declared phase.
RANK = """
import os, sys, time
from trainwatch.rundir.beat import BeatWriter, beat_path
from trainwatch.rundir.run_dir import RunDir
run, mode = RunDir(sys.argv[1]).create(), sys.argv[2]
now = time.time()
run.write_status(0, {"rank": 0, "local_rank": 0, "pid": os.getpid(), "state": "running",
                     "step": 0, "heartbeat_at": now, "last_progress_at": now})
beat, step, since = BeatWriter(beat_path(run.status_dir, 0)), 0, time.time()
while True:
    if mode == "steps":
        step += 1
    beat.write({"v": 1, "rank": 0, "pid": os.getpid(), "heartbeat_at": time.time(),
                "steps_total": step, "step_time_seconds": 0.1,
                "phase": "generate" if mode == "declared" else "backward", "phase_since": since,
                "phase_budget": 600 if mode == "declared" else None})
    if mode == "busy":
        spin = time.monotonic() + 0.1
        while time.monotonic() < spin:
            pass
    else:
        time.sleep(0.1)
"""


@pytest.fixture
def rank(tmp_path):
    procs = []

    def start(mode):
        run = RunDir(tmp_path / f"run-{mode}").create()
        proc = subprocess.Popen([sys.executable, "-c", RANK, str(run.root), mode])
        procs.append(proc)
        wait_for((run.status_dir / "rank-00000.beat").exists, 30, interval=0.1,
                 what=f"the {mode} rank's first beat file")
        time.sleep(0.3)
        return run, {0: (proc.pid, 0)}

    yield start
    for proc in procs:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


def test_progress_seen_only_in_the_beat_file_refutes_the_stall(rank):
    run, ranks = rank("steps")  # its status file never moves again, like on a full disk
    verdict = confirm_stall(run, ranks, min_seconds=2)
    assert not verdict.confirmed and "steps total went from" in verdict.reason
    assert verdict.seconds < 2


def test_a_hung_rank_is_confirmed_after_the_window_and_a_stopped_one_at_once(rank):
    run, ranks = rank("hang")
    verdict = confirm_stall(run, ranks, min_seconds=1.5)
    assert verdict.confirmed and "no rank completed a step in 1.5 s" in verdict.reason
    assert verdict.evidence["first"][0]["process"] in ("sleeping", "running")
    assert "beat files" in verdict.evidence["sources"]
    os.kill(ranks[0][0], signal.SIGSTOP)
    verdict = confirm_stall(run, ranks, min_seconds=5)
    assert verdict.confirmed and "is stopped" in verdict.reason and verdict.seconds < 2


def test_a_rank_in_a_declared_phase_within_its_budget_is_not_stalled(rank):
    run, ranks = rank("declared")
    verdict = confirm_stall(run, ranks, min_seconds=2)
    assert not verdict.confirmed and "declared for it" in verdict.reason


def test_no_rank_process_means_no_kill(tmp_path):
    verdict = confirm_stall(RunDir(tmp_path / "r").create(), {})
    assert not verdict.confirmed


def test_before_the_page_a_busy_rank_is_left_alone_an_idle_hang_is_not(rank):
    """Acting early (busy_refutes): a rank working without a step may be an evaluation
    nobody declared; waiting ranks and a hang use no CPU, so those are still confirmed."""
    run, ranks = rank("busy")
    early = confirm_stall(run, ranks, min_seconds=1.5, busy_refutes=True)
    assert not early.confirmed and "of a core busy" in early.reason, early.reason
    assert confirm_stall(run, ranks, min_seconds=1.5).confirmed  # the page's own look acts
    run, ranks = rank("hang")
    assert confirm_stall(run, ranks, min_seconds=1.5, busy_refutes=True).confirmed
