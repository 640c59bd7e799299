"""One supervisor per run directory, and nothing left behind (issue #21, items 1 and 2).

Real `trainwatch run` processes on the reference trainer (2 ranks under torchrun, paced):
a second supervisor on the same run directory refuses at once (exit 2, naming the
holder's pid and host) and leaves the first one's job alone; SIGKILL of the supervisor
takes its agent, launcher, torchrun and ranks with it, and the same command run again
trains one job; a job that ignores SIGTERM and so outlives its killed supervisor is
found and stopped by the next supervisor before it starts anything.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from agent_helpers import wait_for
from conftest import kill_tree, start_train
from side_by_side import side_by_side
from trainwatch.contract.env import SUPERVISOR_ENV
from trainwatch.node import node_name
from trainwatch.rundir.run_dir import RunDir

pytestmark = pytest.mark.slow

PACE = "slow:delay=0.1"  # a step takes >= 0.1 s: the run outlives what the test does to it


def _trainer_config(tmp_path, steps: int) -> str:
    path = tmp_path / f"train-{steps}.yaml"
    path.write_text(f"train: {{steps: {steps}, batch_size: 4, eval_interval: 1000}}\n"
                    "data: {corpus_bytes: 20000}\n"
                    "checkpoint: {every_steps: 10, fsync: false}\n")
    return str(path)


def _env(tmp_path, **extra: str) -> dict[str, str]:
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(scratch), "OMP_NUM_THREADS": "1", **extra}
    env.pop(SUPERVISOR_ENV, None)
    return env


def _run(tmp_path, run_dir, *args, log: str, env: dict[str, str] | None = None):
    cmd = [sys.executable, "-m", "trainwatch", "run", str(run_dir), "--no-live", *args]
    return subprocess.Popen(cmd, stdout=open(tmp_path / log, "wb"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env or _env(tmp_path))


def _trainer(tmp_path, run_dir, steps: int, *, log: str):
    return _run(tmp_path, run_dir, "--nproc-per-node", "2", "--config",
                _trainer_config(tmp_path, steps), log=log,
                env=_env(tmp_path, TRAINWATCH_FAULT=PACE))


def _step(run: RunDir) -> int:
    return max([s["step"] for s in run.statuses().records if isinstance(s.get("step"), int)],
               default=-1)


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for p in procs:
        try:  # is_running: the pid is still that process (not reused)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def _describe(procs: list[psutil.Process]) -> list[str]:
    """Each process, what it runs and what each of its threads waits in (for a failure)."""
    out = []
    for p in procs:
        try:
            waits = []
            for task in sorted(os.listdir(f"/proc/{p.pid}/task")):
                with open(f"/proc/{p.pid}/task/{task}/wchan") as fh:
                    waits.append(fh.read())
            out.append(f"{p.pid} {p.status()} {' '.join(p.cmdline())[:120]} waits: {waits}")
        except (psutil.Error, OSError):
            out.append(f"{p.pid} (gone)")
    return out


def _kill_all(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def _second_supervisor_is_refused(tmp_path, run: RunDir, first: subprocess.Popen) -> None:
    """A second supervisor on ``run`` exits 2 at once naming ``first`` and leaves its run
    untouched: one controller, one job, the same run.json, ``first`` still running."""
    run_json = run.run_file.read_bytes()
    started = time.monotonic()
    second = _trainer(tmp_path, run.root, 3000, log="second.log")
    try:
        code = second.wait(timeout=60)
    finally:
        kill_tree(second)
    took = time.monotonic() - started
    out = (tmp_path / "second.log").read_text()
    assert code == 2, out[-3000:]
    assert f"pid {first.pid}" in out and (node_name() in out
                                          or socket.gethostname() in out), out
    assert "Traceback" not in out
    assert took < 30, took  # at once: no agent, no torch, nothing started
    assert first.poll() is None
    assert len(run.events("controller_started")) == 1
    assert len(run.events("job_started")) == 1
    assert run.run_file.read_bytes() == run_json


def _a_second_supervisor_exits_2_then_sigkill_of_the_first_takes_every_descendant(tmp_path):
    """One paced run for both: a second supervisor on its directory refuses at once (exit 2,
    naming the holder's pid and host) and leaves it alone; SIGKILL of the holder then takes
    its agent, launcher, torchrun and ranks with it, and the same command run again trains
    one job."""
    run = RunDir(tmp_path / "exp")
    first = _trainer(tmp_path, run.root, 3000, log="first.log")
    tree: list[psutil.Process] = []
    rerun = None
    try:
        wait_for(lambda: _step(run) >= 3 or first.poll() is not None, 240,
                 what="the first run's ranks to train")
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        _second_supervisor_is_refused(tmp_path, run, first)
        wait_for(lambda: _step(run) >= 12 or first.poll() is not None, 240,
                 what="the first run to train past its first checkpoint")
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        tree = psutil.Process(first.pid).children(recursive=True)
        # agent, launcher, torchrun and two ranks (torch may add helpers of its own)
        assert len(tree) >= 5, _describe(tree)
        first.kill()
        first.wait(timeout=30)
        killed_at = time.monotonic()
        while _running(tree) and time.monotonic() - killed_at < 90:
            time.sleep(0.5)
        assert not _running(tree), (_describe(_running(tree)),
                                    run.log_text("torchrun.log")[-3000:])
        # The same command again: one job, resumed from the newest checkpoint, trains on.
        rerun = _trainer(tmp_path, run.root, 3000, log="rerun.log")
        resumed = wait_for(lambda: run.events("checkpoint_resumed") or rerun.poll() is not None,
                           240, what="the rerun to resume")
        assert rerun.poll() is None, (tmp_path / "rerun.log").read_text()[-3000:]
        wait_for(lambda: _step(run) > resumed[0]["step"] + 3, 120, what="the rerun to train")
        rerun.send_signal(signal.SIGINT)
        assert rerun.wait(timeout=120) == 130, (tmp_path / "rerun.log").read_text()[-3000:]
    finally:
        kill_tree(first)
        _kill_all(_running(tree))
        if rerun is not None:
            kill_tree(rerun)
    controllers = run.events("controller_started")
    assert len(controllers) == 2  # the first and the rerun: the refused one journals none
    last = controllers[-1]["time"]
    assert len([e for e in run.events("job_started") if e["time"] >= last]) == 1
    assert len(run.events("launcher_started")) == 2  # one per supervisor, never beside it
    assert not run.events("leftovers_stopped")  # nothing was left to stop


def _a_job_that_outlives_its_killed_supervisor_is_stopped_before_the_next_one_starts(tmp_path):
    """SIGTERM from the dying supervisor does not reach a job that ignores it; the next
    `trainwatch run` finds it by the supervisor's mark in its environment and stops it."""
    run = RunDir(tmp_path / "exp")
    ready = tmp_path / "ignoring-sigterm"
    job = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
           "open(os.environ['READY'], 'w').close(); time.sleep(float(os.environ['JOB_SECONDS']))")
    first = _run(tmp_path, run.root, "--", sys.executable, "-c", job, log="first.log",
                 env=_env(tmp_path, JOB_SECONDS="600", READY=str(ready)))
    orphan = None
    tree: list[psutil.Process] = []
    rerun = None
    try:
        wait_for(lambda: ready.exists() or first.poll() is not None, 120,
                 what="the first job to start ignoring SIGTERM")
        started = run.events("job_started")
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        orphan = psutil.Process(started[0]["pid"])
        tree = psutil.Process(first.pid).children(recursive=True)
        first.kill()
        first.wait(timeout=30)
        time.sleep(1)  # a SIGTERM the dying supervisor's death sends has arrived by now
        assert orphan.is_running() and orphan.status() != psutil.STATUS_ZOMBIE
        rerun = _run(tmp_path, run.root, "--", sys.executable, "-c", job, log="rerun.log",
                     env=_env(tmp_path, JOB_SECONDS="0", READY=str(ready)))
        assert rerun.wait(timeout=180) == 0, (tmp_path / "rerun.log").read_text()[-3000:]
        assert not orphan.is_running() or orphan.status() == psutil.STATUS_ZOMBIE
    finally:
        kill_tree(first)
        _kill_all(_running([*tree, *([orphan] if orphan is not None else [])]))
        if rerun is not None:
            kill_tree(rerun)
    (stopped,) = run.events("leftovers_stopped")
    assert orphan.pid in [p["pid"] for p in stopped["processes"]]
    assert stopped["previous"]["pid"] == first.pid
    starts = run.events("job_started")
    assert len(starts) == 2 and starts[1]["time"] > stopped["time"]


def _a_repeated_sigterm_to_the_launcher_still_stops_torchrun_and_its_ranks(tmp_path):
    """A killed supervisor's PDEATHSIG reaches its child once per thread it had: the
    launcher forwards the first only, so torchrun's own shutdown is not interrupted."""
    run = RunDir(tmp_path / "exp")
    launcher = start_train("--run-dir", str(run.root), "--nproc-per-node", "2",
                           "--config", _trainer_config(tmp_path, 3000), "--max-restarts", "0",
                           env={"TRAINWATCH_FAULT": PACE, "TMPDIR": str(tmp_path)})
    tree: list[psutil.Process] = []
    try:
        wait_for(lambda: _step(run) >= 3 or launcher.poll() is not None, 240,
                 what="the ranks to train")
        tree = psutil.Process(launcher.pid).children(recursive=True)
        # As a dying supervisor's threads end, until the launcher is gone: copies that
        # arrive while it exits must not kill it either (-15 instead of its 143).
        for _ in range(1000):
            if launcher.poll() is not None:
                break
            launcher.send_signal(signal.SIGTERM)
            time.sleep(0.005)
        assert launcher.wait(timeout=90) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while _running(tree) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _running(tree), _describe(_running(tree))
    finally:
        _kill_all(_running(tree))
        kill_tree(launcher)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The three runs side by side: their paced steps are mostly waiting."""
    with side_by_side(request, tmp_path_factory, {
        "test_a_second_supervisor_exits_2_then_sigkill_of_the_first_takes_every_descendant":
            _a_second_supervisor_exits_2_then_sigkill_of_the_first_takes_every_descendant,
        "test_a_job_that_outlives_its_killed_supervisor_is_stopped_before_the_next_one_starts":
            _a_job_that_outlives_its_killed_supervisor_is_stopped_before_the_next_one_starts,
        "test_a_repeated_sigterm_to_the_launcher_still_stops_torchrun_and_its_ranks":
            _a_repeated_sigterm_to_the_launcher_still_stops_torchrun_and_its_ranks,
    }) as running:
        yield running


def test_a_second_supervisor_exits_2_then_sigkill_of_the_first_takes_every_descendant(runs, request):
    runs.result(request)


def test_a_job_that_outlives_its_killed_supervisor_is_stopped_before_the_next_one_starts(runs, request):
    runs.result(request)


def test_a_repeated_sigterm_to_the_launcher_still_stops_torchrun_and_its_ranks(runs, request):
    runs.result(request)
