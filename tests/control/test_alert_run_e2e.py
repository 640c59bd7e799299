"""`trainwatch run` end to end: the real trainer under torchrun, the real agent, the engine.

A rank SIGSTOPs itself -> the agent flags the stall -> TrainingStallSuspected fires -> the
controller confirms the stall itself -> evidence is captured, the survivor writes its step
on the supervisor's request (a dying gasp), the job is killed and restarted -> it resumes
from the gasp, losing no step, and finishes.  A crash loop
trips the no-progress guard, which raises
TrainingRestartLoop.  Needs the agent and checkpoints.
"""

import importlib.util
import json
import os
import signal

import pytest

from agent_helpers import wait_for
from control_helpers import _finish, _run
from conftest import kill_tree
from side_by_side import side_by_side
from trainwatch.rundir.run_dir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("trainwatch.agent.daemon") is None
    or importlib.util.find_spec("trainwatch.rank.checkpoint") is None,
    reason="needs the agent and the checkpoint library")]


def _configs(tmp_path, checkpoint="", **thresholds):
    (tmp_path / "thresholds.yaml").write_text(
        "evaluation_interval: 1s\nstall_for: 2s\naction_min_interval_seconds: 30\n"
        + "".join(f"{k}: {v}\n" for k, v in thresholds.items()))
    (tmp_path / "agent.yaml").write_text(
        "stall: {floor_seconds: 3, k: 10, first_step_seconds: 300}\n"
        "collectors:\n  ranks: {interval: 0.5}\n")
    (tmp_path / "train.yaml").write_text(
        "train: {steps: 80, batch_size: 4, eval_interval: 1000}\n"
        f"checkpoint: {{every_steps: 10, fsync: false{checkpoint}}}\n")



def _sigstopped_rank_is_restarted_from_the_survivors_gasp_and_finishes(tmp_path):
    # Snapshots every 4 steps: without the supervisor's gasp request the restart would go
    # back to the snapshot of step 21 (or older).
    _configs(tmp_path, checkpoint=", memory_snapshots_every: 4")
    run = RunDir(tmp_path / "exp1")
    # Paced (first start only): unpaced, the 80 steps took 1.1 s on a quiet machine and
    # the run finished before rank 1 froze. Rank 1 SIGSTOPs itself as step 23 begins.
    proc = _run(tmp_path, run.root, env={
        "TRAINWATCH_FAULT": "slow:factor=8:launch=1,freeze:rank=1:step=23:launch=1"})
    try:
        def rank_1_at_step_10() -> dict | None:
            status = {s["rank"]: s for s in run.statuses().records}
            return status[1] if (status.get(1, {}).get("step") or 0) >= 10 else None

        frozen_pid = wait_for(rank_1_at_step_10, 300, interval=0.2, what="rank 1 at step 10")["pid"]
        assert _finish(proc) == 0, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        kill_tree(proc)
    events = run.events()
    names = [e["event"] for e in events]
    firing = [e for e in events if e["event"] == "alert_firing"]
    assert firing[0]["alert"] == "TrainingStallSuspected"
    taken = [e for e in events if e["event"] == "action_taken"]
    assert len(taken) == 1 and taken[0]["action"] == "stall_restart"
    assert taken[0]["alert"] == "TrainingStallSuspected" and taken[0]["confirmation"]["confirmed"]
    evidence = taken[0]["evidence"]
    assert os.path.exists(os.path.join(evidence, "rank-00001.json"))
    assert "stopped" in open(os.path.join(evidence, "py-spy-rank-00001.txt")).read()
    stopped = [e for e in events if e["event"] == "job_stopped"][0]
    assert stopped["hard"] and stopped["returncode"] == -signal.SIGKILL
    # Before the kill: rank 0, blocked in step 23's all-reduce, wrote step 22 ... 23 steps
    # done; rank 1, frozen, could not answer (its part of step 23 was sealed at the end).
    (asked,) = [e for e in events if e["event"] == "gasp_requested"]
    assert asked["waiting_for"] == [0] and asked["not_answering"] == [1], asked
    (answered,) = [e for e in events if e["event"] == "gasp_answered"]
    assert answered["steps_written"] == [23] and answered["seconds"] < 5, answered
    assert taken[0]["gasp"]["number"] == asked["number"]
    assert names.index("gasp_answered") < names.index("job_stopped")
    resumed = [e for e in events if e["event"] == "checkpoint_resumed"]
    assert resumed[-1]["state_from"] == "dying gasp" and resumed[-1]["step"] == 23, resumed
    assert resumed[-1]["steps_lost"] == 0 and resumed[-1]["durable_step"] == 20
    finished = [e for e in events if e["event"] == "finished"]
    assert finished and finished[-1]["step"] == 79
    # The story, in order: fired, acted, resumed, finished, stopped.
    firsts = [names.index(n) for n in ("alert_firing", "action_taken", "checkpoint_resumed",
                                       "finished", "controller_stopped")]
    assert firsts == sorted(firsts)
    assert not os.path.exists(f"/proc/{frozen_pid}")


def _crash_loop_trips_the_guard_and_pages(tmp_path):
    _configs(tmp_path, restart_guard_max_restarts=1)
    run = RunDir(tmp_path / "exp1")
    proc = _run(tmp_path, run.root, "--max-restarts", "0",
                env={"TRAINWATCH_FAULT": "exit:rank=1:step=2:attempt=any"})
    assert _finish(proc) == 1, (tmp_path / "run.log").read_text()[-3000:]
    events = run.events()
    assert len([e for e in events if e["event"] == "job_started"]) == 2
    skipped = [e for e in events if e["event"] == "action_skipped"]
    assert "restart guard" in skipped[-1]["reason"]
    loops = [e for e in events if e["event"] == "alert_firing"
             and e["alert"] == "TrainingRestartLoop"]
    assert loops and loops[0]["severity"] == "critical" and loops[0]["labels"]["run"] == "exp1"
    # each start dies before it publishes a step: still a restart loop, not a failed start
    fired = [e["alert"] for e in events if e["event"] == "alert_firing"]
    assert "TrainingStartupFailed" not in fired, fired
    assert json.loads((run.root / "alerts" / "actions.json").read_text())["guard_tripped"]
    # --no-live still says why it gave up, not only the exit code
    assert ("the job failed and was not restarted: restart guard"
            in (tmp_path / "run.log").read_text())


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Both runs side by side: the stall's detection window and the restarts mostly wait."""
    with side_by_side(request, tmp_path_factory, {
        "test_sigstopped_rank_is_restarted_from_the_survivors_gasp_and_finishes":
            _sigstopped_rank_is_restarted_from_the_survivors_gasp_and_finishes,
        "test_crash_loop_trips_the_guard_and_pages":
            _crash_loop_trips_the_guard_and_pages,
    }) as running:
        yield running


def test_sigstopped_rank_is_restarted_from_the_survivors_gasp_and_finishes(runs, request):
    runs.result(request)


def test_crash_loop_trips_the_guard_and_pages(runs, request):
    runs.result(request)
