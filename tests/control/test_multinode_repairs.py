"""A multi-node job's supervision without torchrun: who leads, how a follower's finding
reaches the leader, that one decision is carried out once on every node, and that a
node's repair kills its ranks (a SIGSTOPped one too) but never its launcher.

The real thing, 2 nodes x 2 ranks in network namespaces, is
tests/deploy/test_multinode_netns.py.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from agent_helpers import wait_for
from trainwatch.control import actions
from trainwatch.control.actions import ActionRequest, ActionRunner, Policy
from trainwatch.control.confirm import Confirmation
from trainwatch.control.controller import JobController
from trainwatch.control.job_nodes import JobNodes, job_nodes, rendezvous_args
from trainwatch.control.repairs import NodeRepairs, RepairBoard
from trainwatch.control.run import run as run_command
from trainwatch.errors import ConfigError
from trainwatch.rundir.run_dir import RunDir

LEADER = JobNodes("node-a", 0, 2)
FOLLOWER = JobNodes("node-b", 1, 2)


def test_node_rank_0_leads_and_a_one_node_job_has_no_nodes(monkeypatch):
    # job_nodes sets $TRAINWATCH_NODE for what the supervisor starts: set first, so the
    # test's end restores the variable (delenv of an absent one records nothing).
    monkeypatch.setenv("TRAINWATCH_NODE", "placeholder")
    monkeypatch.delenv("TRAINWATCH_NODE")
    assert job_nodes(1, None, None) is None
    leader = job_nodes(2, 0, "n0")
    assert leader == JobNodes("n0", 0, 2) and leader.leader
    assert os.environ["TRAINWATCH_NODE"] == "n0"  # the agent, journal and ranks agree
    assert not job_nodes(2, 1, "n1").leader
    for args, key in (((2, None, "n0"), "--node-rank"), ((2, 2, "n0"), "--node-rank"),
                      ((1, 1, None), "--node-rank"), ((2, 0, " n0"), "--node-name")):
        with pytest.raises(ConfigError) as err:
            job_nodes(*args)
        assert err.value.key == key and err.value.exit_code == 2
    assert rendezvous_args(leader, "10.0.0.1:29400", "10.0.0.1") == [
        "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "10.0.0.1:29400",
        "--node-name", "n0", "--local-addr", "10.0.0.1"]
    with pytest.raises(ConfigError, match="needs the rendezvous"):
        rendezvous_args(leader, None, None)
    with pytest.raises(ConfigError, match="give --nnodes too"):
        rendezvous_args(None, "10.0.0.1:29400", None)
    # Elastic: each node's launcher gets --min-nnodes (torchrun --nnodes MIN:MAX).
    assert rendezvous_args(leader, "10.0.0.1:29400", None, 1)[-2:] == ["--min-nnodes", "1"]
    with pytest.raises(ConfigError, match="give --nnodes too") as err:
        rendezvous_args(None, None, None, 1)
    assert err.value.key == "--min-nnodes"


def test_run_refuses_a_multi_node_launch_it_cannot_place_before_touching_anything(tmp_path):
    run_dir = tmp_path / "exp"
    for extra, key in ((["--nnodes", "2"], "--node-rank"),
                       (["--nnodes", "2", "--node-rank", "1"], "--rdzv-endpoint")):
        done = CliRunner().invoke(run_command, [str(run_dir), "--nproc-per-node", "1", *extra])
        assert isinstance(done.exception, ConfigError) and done.exception.key == key, done.output
    # An own COMMAND's elasticity is its torchrun's --nnodes MIN:MAX, not ours.
    done = CliRunner().invoke(run_command, [str(run_dir), "--min-nnodes", "1", "--", "true"])
    assert isinstance(done.exception, ConfigError) and done.exception.key == "--min-nnodes"
    assert not run_dir.exists()


class FakeJob:
    """What the action runner and the repairs need of a node's controller; a restart of
    the launcher must never happen in a multi-node stall repair."""

    def __init__(self, run: RunDir, ranks: list[int]):
        self.run, self.ranks = run, ranks
        self.lock = threading.RLock()
        self.closed = False
        self.killed: list[float] = []

    def alive(self) -> bool:
        return True

    def rank_processes(self) -> dict[int, tuple[int, int]]:
        return {}

    def progress_step(self) -> int:
        return 20

    def resume_point(self) -> tuple[int, str]:
        return 20, "checkpoint"

    def capture_evidence(self, label: str) -> Path:
        return self.run.diagnostics_dir / label

    def kill_ranks(self, before: float) -> list[int]:
        self.killed.append(before)
        return self.ranks

    def journal(self, event: str, **fields) -> None:
        self.run.append_event(event, "engine", **fields)

    def restart(self, *args, **kwargs):
        raise AssertionError("a multi-node stall repair restarted a launcher")


def _stall(fingerprint: str) -> ActionRequest:
    return ActionRequest("TrainingStallSuspected", "stall_restart", {"culprit_rank": "2"},
                         fingerprint, "2026-12-06T08:00:00Z", "engine")


def test_one_decision_by_the_leader_is_carried_out_once_on_every_node(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "exp").create()
    monkeypatch.setattr(actions, "confirm_stall", lambda *a, **k: Confirmation(
        True, "rank 2 (pid 1) is stopped", 0.1))
    policy = Policy(min_interval_seconds=30)
    jobs = {n.node: FakeJob(run, [10 + n.node_rank]) for n in (LEADER, FOLLOWER)}
    boards = {n.node: RepairBoard(run, n) for n in (LEADER, FOLLOWER)}
    runners = {n.node: ActionRunner(run, jobs[n.node], policy, board=boards[n.node])  # type: ignore[arg-type]
               for n in (LEADER, FOLLOWER)}
    repairs = {name: NodeRepairs(boards[name], runners[name], jobs[name]) for name in boards}

    # The follower confirms on its node and proposes; twice (two of its alerts) before
    # the leader looks: both knew of no request.
    for fingerprint in ("f1", "f2"):
        outcome = runners["node-b"].handle(_stall(fingerprint))
        assert not outcome.taken and "proposed to the job's leader" in outcome.reason
    assert len(run.events("repair_proposed")) == 2 and not run.events("action_taken")
    repairs["node-b"].check()  # a follower decides nothing
    assert boards["node-a"].newest() == 0

    repairs["node-a"].check()  # the leader decides the first, drops the second, applies
    (requested,) = run.events("repair_requested")
    assert requested["number"] == 1 and requested["node"] == "node-a"
    assert requested["proposed_by"] == "node-b"
    (taken,) = run.events("action_taken")
    assert taken["action"] == "stall_restart" and taken["request"] == 1
    assert taken["confirmation"]["reason"] == "confirmed on node node-b"
    assert "already repaired" in run.events("action_skipped")[0]["reason"]
    assert not boards["node-a"].proposals()  # decided: never decided twice

    repairs["node-b"].check()
    repairs["node-b"].check()
    repairs["node-a"].check()
    applied = run.events("repair_applied")
    assert sorted((e["node"], e["number"], tuple(e["killed"])) for e in applied) == [
        ("node-a", 1, (10,)), ("node-b", 1, (11,))]
    assert len(jobs["node-a"].killed) == len(jobs["node-b"].killed) == 1

    # The leader's own alert of the same incident, after the repair: rate limited.
    late = runners["node-a"].handle(_stall("f3"))
    assert not late.taken and "rate limited" in late.reason
    # A supervisor started later (a restarted node) takes old requests as history.
    assert NodeRepairs(boards["node-b"], runners["node-b"], jobs["node-b"]).baseline == 1
    # The follower keeps its own ledger; the job's is the leader's.
    assert runners["node-a"].ledger_path == run.actions_ledger_file
    assert runners["node-b"].ledger_path.name == "actions.node-b.json"


def test_a_rollback_is_left_to_a_person_across_nodes(tmp_path):
    run = RunDir(tmp_path / "exp").create()
    runner = ActionRunner(run, FakeJob(run, []), Policy(),  # type: ignore[arg-type]
                          board=RepairBoard(run, LEADER))
    outcome = runner.handle(ActionRequest("TrainingLossNonFinite", "rollback_skip", {}, "r",
                                          "2026-12-06T08:00:00Z", "engine"))
    assert not outcome.taken and "multi-node" in outcome.reason


# A launcher that starts two "ranks", publishes their status files and, like torchrun,
# outlives them.
LAUNCHER = """
import subprocess, sys, time
from trainwatch.rundir.run_dir import RunDir
run = RunDir(sys.argv[1])
for rank in range(2):
    kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    run.write_status(rank, {"job": "exp", "rank": rank, "pid": kid.pid, "node": "n0",
                            "state": "running", "step": 1, "heartbeat_at": time.time()})
while True:
    time.sleep(0.1)
"""


def test_a_repair_kills_the_nodes_ranks_even_a_stopped_one_and_never_the_launcher(tmp_path):
    run = RunDir(tmp_path / "exp").create()
    controller = JobController(run, [sys.executable, "-c", LAUNCHER, str(run.root)])
    controller.start()
    try:
        wait_for(lambda: len(run.statuses().records) == 2, 30, what="two ranks")
        pids = sorted(s["pid"] for s in run.statuses().records)
        assert controller.kill_ranks(before=time.time() - 60) == []  # started after: not ours
        os.kill(pids[1], signal.SIGSTOP)
        assert controller.kill_ranks(before=time.time()) == pids
        for pid in pids:
            wait_for(lambda pid=pid: not psutil.pid_exists(pid)
                     or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 10,
                     what=f"rank pid {pid} to end")
        assert controller.alive()  # the launcher (and a rendezvous it hosts) lives on
    finally:
        controller.close("test over")
    assert not controller.alive()


def test_receive_runs_a_node_of_a_multi_node_job_only_with_its_job(tmp_path, monkeypatch):
    from trainwatch.control.cli import _job, receive
    monkeypatch.setenv("TRAINWATCH_RECEIVER_TOKEN", "s3cret-token-for-tests")
    base = ["--run-dir", str(tmp_path / "exp"), "--nnodes", "2", "--node-rank", "1"]
    for extra, key in (([], "--nnodes"),
                       (["--job-command", "torchrun x.py", "--rdzv-endpoint", "h:1"],
                        "--rdzv-endpoint")):
        done = CliRunner().invoke(receive, [*base, *extra])
        assert isinstance(done.exception, ConfigError) and done.exception.key == key, done.output
    assert not (tmp_path / "exp").exists()
    job = _job(RunDir(tmp_path / "exp"), None, 2, None, None,
               rendezvous_args(FOLLOWER, "10.0.0.1:29400", None))
    assert job is not None and job.command[-8:] == [
        "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "10.0.0.1:29400",
        "--node-name", "node-b"]


def test_a_node_whose_launcher_exited_starts_its_own_again_with_the_same_command(tmp_path):
    """Its restarts spent or its store lost, a node's launcher exits: that node's own
    supervisor starts it again (same command, same rendezvous), no request, no proposal."""
    run = RunDir(tmp_path / "exp").create()

    class Exited(FakeJob):
        def alive(self) -> bool:
            return False

        def restart(self, reason: str, *, hard: bool = False) -> int:
            self.restarted = (reason, hard)
            return 4242

    job = Exited(run, [])
    runner = ActionRunner(run, job, Policy(), board=RepairBoard(run, FOLLOWER))  # type: ignore[arg-type]
    outcome = runner.restart_job("restart", only_if_exited=True)
    assert outcome.taken and outcome.details["pid"] == 4242 and job.restarted == ("restart", False)
    assert not run.events("repair_proposed") and not run.events("repair_requested")


def _incident(run: RunDir, now: float, failed: tuple[int, ...] = (), rank_down_at=None) -> None:
    """2 nodes x 2 ranks as the nodes-rank-killed drill left them (rank 3 on node-b
    SIGKILLed at step 17): statuses of the current workers, started 20 s ago."""
    for rank in range(4):
        run.write_status(rank, {"rank": rank, "local_rank": rank % 2, "world_size": 4,
                                "node": "node-a" if rank < 2 else "node-b", "pid": 100 + rank,
                                "started_at": now - 20, "step": 17,
                                "state": "failed" if rank in failed else "running",
                                "phase": "failed" if rank in failed else "forward",
                                "phase_since": now - 3})
    if rank_down_at is not None:  # node-b's engine saw rank 3's process gone
        run.append_event("alert_firing", "engine", time=rank_down_at, alert="TrainingRankDown",
                         labels={"rank": "3", "node": "node-b", "alertname": "TrainingRankDown"})


@pytest.mark.parametrize("evidence", ["rank gone here", "rank failed", "rank down elsewhere"])
def test_a_dead_rank_under_a_restarting_torchrun_is_left_to_torchrun(tmp_path, monkeypatch,
                                                                       evidence):
    """The drill's race: the stall alert fired on node-a while every torchrun was already
    restarting its workers after rank 3's death; the leader's look saw rank 0 gone (its
    torchrun stopping it) and repaired a stall. Each piece of evidence alone holds it."""
    run = RunDir(tmp_path / "exp").create()
    now = time.time()
    last = {0: {"pid": 100, "process": "gone" if evidence == "rank gone here" else "sleeping",
                "phase": "forward"}, 1: {"pid": 101, "process": "sleeping", "phase": "forward"}}
    monkeypatch.setattr(actions, "confirm_stall", lambda *a, **k: Confirmation(
        True, "rank 0 (pid 100) is gone" if evidence == "rank gone here"
        else "no rank completed a step in 2.0 s", 0.8, {"last": last}))
    _incident(run, now, failed=(2,) if evidence == "rank failed" else (),
              rank_down_at=now - 6 if evidence == "rank down elsewhere" else None)
    runner = ActionRunner(run, FakeJob(run, [10]), Policy(min_interval_seconds=30),  # type: ignore[arg-type]
                          board=RepairBoard(run, LEADER))

    outcome = runner.handle(_stall("s1"))

    assert not outcome.taken and not outcome.final  # asked again if torchrun never does
    assert "left to torchrun" in outcome.reason, outcome.reason
    assert {"rank gone here": "rank 0 (pid 100) exited",
            "rank failed": "rank 2 on node-b failed",
            "rank down elsewhere": "rank 3 is down (TrainingRankDown from node-b"}[
        evidence] in outcome.reason
    assert not run.events("repair_requested") and not run.events("action_taken")
    (skipped,) = run.events("action_skipped")
    assert skipped["confirmation"]["reason"] == outcome.details["confirmation"]["reason"]


def test_a_stall_beside_an_old_or_repaired_rank_death_is_still_repaired(tmp_path, monkeypatch):
    """What is not a restart round under way: a TrainingRankDown about the rank's previous
    process, a failure torchrun has had RESTART_ROUND_SECONDS to repair, a launcher gone."""
    from trainwatch.control.restart_round import RESTART_ROUND_SECONDS, failure_under_way
    run = RunDir(tmp_path / "exp").create()
    now = time.time()
    _incident(run, now, rank_down_at=now - 30)  # before rank 3's current start (now - 20)
    assert failure_under_way(run, launcher_alive=True, now=now) is None
    _incident(run, now, failed=(1,))
    assert "rank 1 on node-a failed 3.0 s ago" in str(failure_under_way(run, launcher_alive=True,
                                                                          now=now))
    assert failure_under_way(run, launcher_alive=True, now=now + RESTART_ROUND_SECONDS) is None
    assert failure_under_way(run, launcher_alive=False, now=now) is None
    monkeypatch.setattr(actions, "confirm_stall", lambda *a, **k: Confirmation(
        True, "rank 2 (pid 1) is stopped", 0.1, {"last": {2: {"pid": 1, "process": "stopped"}}}))
    run = RunDir(tmp_path / "late").create()  # rank 1 failed, torchrun never restarted it
    _incident(run, now - RESTART_ROUND_SECONDS - 5, failed=(1,))
    runner = ActionRunner(run, FakeJob(run, [10]), Policy(min_interval_seconds=30),  # type: ignore[arg-type]
                          board=RepairBoard(run, LEADER))
    assert runner.handle(_stall("s2")).taken and run.events("repair_requested")
