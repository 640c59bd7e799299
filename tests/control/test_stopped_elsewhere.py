"""A node of a multi-node job whose job ended because another node's `trainwatch run` was
stopped on request ends as stopped (exit 130, naming that node), not restarted and not
failed; a job that crashed, with no such stop journaled since it started, is restarted as
before. The journal alone decides (its order, not the nodes' clocks)."""

import sys

from trainwatch.control.actions import ActionRunner, Policy
from trainwatch.control.controller import JobController
from trainwatch.control.outcome import Ending
from trainwatch.control.stopped_elsewhere import (STOPPING_EVENT, stopped_elsewhere,
                                                  stopped_words, wait_stopped_elsewhere)
from trainwatch.control.supervise import Supervisor
from trainwatch.node import node_name
from trainwatch.rundir.run_dir import RunDir

HERE, THERE = "node-1", "node-0"


def journal(run: RunDir, host: str, event: str, **fields) -> None:
    run.append_event(event, "engine", host=host, **fields)  # as that node's supervisor


def started(run: RunDir, pid: int = 41) -> None:
    journal(run, HERE, "job_started", pid=pid, reason="trainwatch run", attempt=1)


def test_another_nodes_stop_on_request_since_the_job_started_is_named(tmp_path):
    run = RunDir(tmp_path).create()
    started(run)
    journal(run, THERE, STOPPING_EVENT, reason="interrupted")
    assert stopped_elsewhere(run, HERE, 41) == THERE
    assert f"node {THERE} was stopped on request" in stopped_words(THERE)


def test_a_crash_is_not_a_stop_elsewhere(tmp_path):
    run = RunDir(tmp_path).create()
    journal(run, THERE, STOPPING_EVENT, reason="interrupted")  # before this job started
    started(run)
    journal(run, HERE, STOPPING_EVENT, reason="interrupted")   # this node's own
    journal(run, THERE, "job_stopped", reason="stall_restart", returncode=-9)  # a repair
    journal(run, THERE, "controller_stopped", interrupted=False, exit_code=1)
    journal(run, THERE, "checkpoint_requested", step=5, stop=True)  # torchrun's re-rendezvous
    assert stopped_elsewhere(run, HERE, 41) is None
    assert stopped_elsewhere(run, HERE, 99) is None  # another start of this node: not in it


def test_an_older_supervisors_records_of_its_stop_count_too(tmp_path):
    for event, fields in (("job_stopped", {"reason": "interrupted", "returncode": 1}),
                          ("controller_stopped", {"interrupted": True, "exit_code": 130})):
        run = RunDir(tmp_path / event).create()
        started(run)
        journal(run, THERE, event, **fields)
        assert stopped_elsewhere(run, HERE, 41) == THERE, event


def test_a_stop_journaled_a_moment_after_the_job_ended_is_waited_for(tmp_path):
    run = RunDir(tmp_path).create()
    started(run)
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds
        if now[0] >= 0.5 and len(run.events(STOPPING_EVENT)) == 0:
            journal(run, THERE, STOPPING_EVENT, reason="interrupted")

    assert wait_stopped_elsewhere(run, HERE, 41, clock=lambda: now[0], sleep=sleep) == THERE
    now[0] = 0.0
    crashed = RunDir(tmp_path / "crashed").create()
    started(crashed)
    assert wait_stopped_elsewhere(crashed, HERE, 41, grace=2.0, clock=lambda: now[0],
                                  sleep=lambda s: now.__setitem__(0, now[0] + s)) is None
    assert 2.0 <= now[0] < 2.2  # it gave up after the grace


def _supervised(tmp_path, stop_there: bool) -> tuple[Supervisor, JobController]:
    controller = JobController(tmp_path / "run", [sys.executable, "-c", "raise SystemExit(1)"],
                               stop_grace_seconds=3)
    run = controller.run
    sup = Supervisor(controller, ActionRunner(run.root, controller, Policy()),
                     stopped_elsewhere=lambda pid: wait_stopped_elsewhere(
                         run, node_name(), pid, grace=0))
    controller.start()
    # a rank of this start published (after the start: a status older than it is a
    # launch failure's, whatever the machine's load made of the gap)
    controller.run.write_status(2, {"rank": 2, "pid": 1, "state": "running", "step": 7})
    if stop_there:
        journal(run, THERE, STOPPING_EVENT, reason="interrupted")
    controller.proc.wait(30)
    return sup, controller


def test_the_supervisor_ends_stopped_instead_of_restarting(tmp_path):
    sup, controller = _supervised(tmp_path, stop_there=True)
    sup.check()
    assert sup.finished.is_set() and sup.outcome is not None
    assert sup.outcome.ending is Ending.STOPPED and sup.outcome.exit_code == 130
    assert sup.outcome.why == stopped_words(THERE)
    assert controller.closed and controller.starts == 1  # not restarted
    (exited,) = controller.run.events("job_exited")
    assert exited["returncode"] == 1 and exited["stopped_elsewhere"] == THERE
    assert sup.outcome.message(controller.run, None) == f"trainwatch run: {stopped_words(THERE)}"


def test_the_supervisor_restarts_a_job_that_crashed(tmp_path):
    sup, controller = _supervised(tmp_path, stop_there=False)
    try:
        sup.check()
        assert controller.starts == 2 and not sup.finished.is_set()  # restarted, as before
    finally:
        controller.close("test teardown")
