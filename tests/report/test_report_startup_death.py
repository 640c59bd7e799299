"""A supervisor SIGKILLed while no rank of its ran is an incident of its own (issue #36 item 5).

`trainwatch run` killed in its start-up leaves only the next supervisor's `supervisor_died`:
it fell before the first attempt and `report` dropped it (no incident at all), or into an
attempt that had already stopped, whose cause then read "the job stopped with it". Journals
written in-process, the way the controller writes them; the report built in-process."""

import io
import os
import subprocess
import sys

import pytest
from rich.console import Console

from agent_helpers import wait_for
from conftest import kill_tree
from report_helpers import T0, Run, assert_sums_to_wall, near, report_json
from trainwatch.contract.env import SUPERVISOR_ENV
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.runlock import recorded_holder
from trainwatch.control.outcome import Ending, RunOutcome
from trainwatch.control.run_summary import summarize
from trainwatch.report import cost, goodput, html, render, timeline
from trainwatch.report.series import read_series


def _report(run):
    tl = timeline.read_timeline(run)
    return render.report(tl, goodput.account(tl), cost.load_settings(None))


def _killed_in_startup(r: Run, pid: int, role: str = "trainwatch run") -> float:
    """A supervisor that took the lock, beat once and was SIGKILLed before it launched
    anything; 5 s later the next one finds it dead. Returns its last beat (its death)."""
    since = r.clock
    r.event("controller_started", "engine")
    r.wait(0.5)
    beat = r.clock
    r.wait(5)
    r.event("supervisor_died", "supervisor", node=None, last_beat_at=T0 + beat,
            previous={"pid": pid, "host": "h", "role": role, "since": T0 + since})
    return beat


def _session(r: Run, pid: int, first: int, last: int, *, resumed: int | None = None,
             stop_at: int | None = None) -> None:
    """One `trainwatch run` session: its job trains first..last, then finishes (or is
    stopped on request at ``stop_at``, saving there)."""
    r.event("controller_started", "engine")
    r.event("job_started", "engine", pid=pid, reason="trainwatch run", attempt=1)
    r.event("launcher_started", "launcher", pid=pid)
    r.wait(1)
    r.attempt(0)
    if resumed is not None:
        r.rank_event("checkpoint_resumed", step=resumed)
    r.rank_event("run_started", world_size=2, start_step=first, steps=30)
    r.steps(first, last)
    if stop_at is None:
        r.rank_event("finished", step=last, steps=30)
        r.event("launcher_exited", "launcher", exit_code=0)
        r.event("job_exited", "engine", pid=pid, returncode=0)
    else:
        r.rank_event("checkpoint_saved", step=stop_at, reason="stop", mode="sync",
                     blocking_seconds=0.1)
        r.event("job_stopped", "engine", pid=pid, reason="SIGINT")
    r.event("controller_stopped", "engine", exit_code=0)


def test_a_supervisor_killed_before_its_first_rank_is_an_incident(tmp_path):
    r = Run(tmp_path / "run")
    died = _killed_in_startup(r, pid=4242)
    relaunched = r.clock
    _session(r, 60, 0, 29)
    data = _report(r.run)
    assert_sums_to_wall(data)
    assert data["time"]["start"] == near(T0 + relaunched)  # nothing of the dead one billed
    (death,) = data["incidents"]
    assert death["kind"] == "supervisor_died" and death["outcome"] == "supervisor_died"
    assert death["attempt"] is None and death["time"] == near(T0 + died)
    assert death["steps_lost"] == 0 and death["total_seconds"] == 0
    assert death["evidence"]["supervisor_died"] == [
        {"pid": 4242, "node": None, "role": "trainwatch run", "last_beat_at": T0 + died}]
    assert death["cause"] == (
        "the supervisor `trainwatch run` (pid 4242) died without a word (SIGKILL, a crash or "
        "an OOM kill; found by the next supervisor) in its start-up, before any rank "
        "started: no step was lost, nothing ran until the next start")
    assert [a["outcome"] for a in data["attempts"]] == ["finished"]
    assert data["checkpoint_hint"] is None  # it lost no step: no interval would help

    out = io.StringIO()
    render.render(data, Console(file=out, width=300))
    assert "none      before the start   the supervisor `trainwatch run` (pid 4242) died" \
        in out.getvalue(), out.getvalue()
    page = html.page(data, read_series(r.run))
    assert "<tr><td>none</td><td>the supervisor `trainwatch run` (pid 4242) died" in page
    summary = summarize(r.run, RunOutcome(Ending.FINISHED))
    assert summary.incidents == [death["cause"]]


def test_a_supervisor_killed_between_a_stop_and_the_next_start_is_not_the_stops_cause(
        tmp_path):
    """Stopped on request at step 12; the next `trainwatch train` killed in its start-up;
    the third resumes. The stop read "its supervisor (pid 4242) died without a word …: the
    job stopped with it; checkpoint saved at step 12 as the workers were stopped"."""
    r = Run(tmp_path / "run")
    _session(r, 50, 0, 11, stop_at=12)
    died = _killed_in_startup(r, pid=4242, role="trainwatch train")
    _session(r, 60, 12, 29, resumed=12)
    data = _report(r.run)
    assert_sums_to_wall(data)
    stop, death = data["incidents"]
    assert (stop["kind"], stop["attempt"], stop["outcome"]) == ("attempt", 0, "stopped")
    assert stop["cause"] == "stopped on request, checkpoint saved at step 12", stop["cause"]
    assert stop["evidence"]["supervisor_died"] == []
    assert (death["kind"], death["attempt"], death["time"]) == ("supervisor_died", None,
                                                                near(T0 + died))
    assert death["resumed_from"] == 12
    assert death["cause"].startswith(
        "the launcher `trainwatch train` (pid 4242) died without a word (SIGKILL, a crash or "
        "an OOM kill; found by the next supervisor) after attempt 0 had ended, before any "
        "rank of a new attempt started"), death["cause"]


@pytest.mark.slow
def test_a_real_trainwatch_run_killed_before_its_job_is_listed_by_report(tmp_path):
    """`trainwatch run` SIGKILLed once its lock file exists (before its job started),
    then the same command again, to its end: `report --json` lists the death."""
    run = RunDir(tmp_path / "exp")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(SUPERVISOR_ENV, None)
    cmd = [sys.executable, "-m", "trainwatch", "run", str(run.root), "--no-live", "--",
           sys.executable, "-c", "print('trained')"]
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             stdin=subprocess.DEVNULL, env=env)
    try:
        # the lock naming its holder (the file is made a moment before the record is
        # written: a supervisor killed in between names no one, and nothing ran)
        wait_for(lambda: recorded_holder(run) is not None or first.poll() is not None, 60,
                 interval=0.005, what="the first supervisor's lock")
        first.kill()
        first.wait(timeout=30)
        if run.events("job_started"):  # a loaded machine let it reach its job: another case
            pytest.skip("the supervisor started its job before the kill arrived")
        again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120,
                               stdin=subprocess.DEVNULL)
    finally:
        kill_tree(first)
    assert again.returncode == 0, again.stdout + again.stderr
    deaths = [i for i in report_json(run.root)["incidents"] if i["kind"] == "supervisor_died"]
    assert [d["evidence"]["supervisor_died"][0]["pid"] for d in deaths] == [first.pid]
    assert "in its start-up, before any rank started" in deaths[0]["cause"]
