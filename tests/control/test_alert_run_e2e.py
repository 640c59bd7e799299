"""`trainwatch run` end to end: the real trainer under torchrun, the real agent, the engine.

SIGSTOP a rank -> the agent flags the stall -> TrainingStallSuspected fires -> the
controller confirms the stall itself -> evidence is captured, the job is killed and
restarted -> it resumes from its newest verified checkpoint and finishes.  A crash loop
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
from trainwatch.rundir.run_dir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("trainwatch.agent.daemon") is None
    or importlib.util.find_spec("trainwatch.rank.checkpoint") is None,
    reason="needs the agent and the checkpoint library")]


def _configs(tmp_path, **thresholds):
    (tmp_path / "thresholds.yaml").write_text(
        "evaluation_interval: 1s\nstall_for: 2s\naction_min_interval_seconds: 30\n"
        + "".join(f"{k}: {v}\n" for k, v in thresholds.items()))
    (tmp_path / "agent.yaml").write_text(
        "stall: {floor_seconds: 3, k: 10, first_step_seconds: 300}\n"
        "collectors:\n  ranks: {interval: 0.5}\n")
    (tmp_path / "train.yaml").write_text(
        "train: {steps: 80, batch_size: 4, eval_interval: 1000}\n"
        "checkpoint: {every_steps: 10, fsync: false}\n")



def test_sigstopped_rank_is_restarted_from_checkpoint_and_finishes(tmp_path):
    _configs(tmp_path)
    run = RunDir(tmp_path / "exp1")
    # Paced (first start only): unpaced, the 80 steps took 1.1 s on a quiet machine and
    # the run finished before the test saw step 20 and could SIGSTOP a rank.
    proc = _run(tmp_path, run.root, env={"TRAINWATCH_FAULT": "slow:factor=8:launch=1"})
    try:
        def rank_1_at_step_20() -> dict | None:
            status = {s["rank"]: s for s in run.statuses().records}
            return status[1] if (status.get(1, {}).get("step") or 0) >= 20 else None

        frozen_pid = wait_for(rank_1_at_step_20, 300, interval=0.2, what="rank 1 at step 20")["pid"]
        os.kill(frozen_pid, signal.SIGSTOP)
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
    resumed = [e for e in events if e["event"] == "checkpoint_resumed"]
    # A checkpoint's step counts completed steps, and the status file trails the rank by up
    # to a heartbeat, so the frozen rank may be past the step its status showed: what
    # matters is that the job resumed from state saved before the restart.
    saved_before = {e["step"] for e in events[:names.index("action_taken")]
                    if e["event"] == "checkpoint_saved"}
    last = resumed[-1] if resumed else {}
    if last.get("state_from") == "memory snapshot":
        # From memory (the default): past the checkpoint saved before the restart, at or
        # past the step the frozen rank's status showed: at most the step in flight lost.
        assert last["durable_step"] in saved_before and last["step"] > last["durable_step"]
        assert last["step"] >= 20, last
    else:  # no snapshot newer than that checkpoint (the freeze came right after a save)
        assert last and last["step"] > 0 and last["step"] in saved_before, last
    finished = [e for e in events if e["event"] == "finished"]
    assert finished and finished[-1]["step"] == 79
    # The story, in order: fired, acted, resumed, finished, stopped.
    firsts = [names.index(n) for n in ("alert_firing", "action_taken", "checkpoint_resumed",
                                       "finished", "controller_stopped")]
    assert firsts == sorted(firsts)
    assert not os.path.exists(f"/proc/{frozen_pid}")


def test_crash_loop_trips_the_guard_and_pages(tmp_path):
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
