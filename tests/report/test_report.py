"""`trainwatch report` on synthetic run directories written with the run-directory writers
(RunDir, append_jsonl) at chosen times, so every category has an exact expected value:
restarts, stall restarts, stop-and-relaunch, rollbacks, torn lines, cost, the textfile."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from trainwatch.contract.metrics import METRICS
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.atomic import append_jsonl
from report_helpers import T0, Run, assert_sums_to_wall, near, report, report_json

DOCS = Path(__file__).resolve().parents[2] / "docs" / "report.md"


def crash_and_restart(tmp_path):
    """30 steps of 1 s (0.1 s data wait, 0.01 s between steps); eval after step 9 and 19;
    saves of step 10, 20 and 30; rank 1 SIGKILLed in step 15; restart resumes from 10."""
    r = Run(tmp_path / "run")
    r.event("launcher_started", "launcher", pid=1)
    r.wait(2)
    pids = r.attempt(0)
    r.wait(1)
    r.rank_event("run_started", world_size=2, start_step=0, steps=30)
    r.wait(1)                                               # first step starts at t=4
    r.steps(0, 9, gap=0.01)
    r.evaluation(9, 0.5)
    r.save(10, 0.25)
    r.steps(10, 14, gap=0.01)
    crashed_after = r.clock                                 # step 14 ended (+ gap)
    r.wait(0.1)
    r.rank_event("fault_injected", 1, step=15, fault="kill")
    r.wait(0.1)
    r.rank_event("failed", 0, error="RuntimeError: Connection reset by peer")
    r.torchrun_failed(pids[1], 1, -9)
    r.wait(3)
    r.attempt(1)
    r.wait(1)
    r.rank_event("checkpoint_resumed", step=10, path="checkpoints/step-00000010")
    r.rank_event("restarted", restart_count=1, world_size=2, start_step=10, steps=30)
    r.wait(1)
    restarted_at = r.clock
    r.steps(10, 19, gap=0.01)
    r.evaluation(19, 0.5)
    r.save(20, 0.25)
    r.steps(20, 29, gap=0.01)
    r.evaluation(29, 0.5)
    r.rank_event("finished", step=29, steps=30)
    r.save(30, 0.25, reason="final")
    r.wait(2)
    r.event("launcher_exited", "launcher", exit_code=0, torchrun_returncode=0, signal=None)
    return r, crashed_after, restarted_at


# --------------------------------------------------------------------------- accounting

def test_a_restart_recomputes_crash_step_minus_resumed_checkpoint(tmp_path):
    r, crashed_after, restarted_at = crash_and_restart(tmp_path)
    data = report_json(r.run.root)
    assert_sums_to_wall(data)
    (incident,) = data["incidents"]
    fault = RunDir(r.run.root).events("fault_injected")[0]["step"]
    resumed = RunDir(r.run.root).events("checkpoint_resumed")[0]["step"]
    assert incident["steps_lost"] == fault - resumed == 5
    assert incident["lost_steps"] == {"first": 10, "last": 14}
    assert incident["resumed_from"] == 10 and incident["last_step"] == 14
    assert incident["recomputed_seconds"] == near(5.0)
    # From the last completed step (its 0.01 s idle tail included) to the restart's first step.
    assert incident["restart_downtime_seconds"] == near(restarted_at
                                                                 - (crashed_after - 0.01))
    assert incident["stalled_seconds"] == 0
    assert "rank 1 killed by SIGKILL" in incident["cause"]
    assert "kill on rank 1 at step 15" in incident["cause"]
    assert incident["evidence"]["exits"] == [{"rank": 1, "pid": r.pid - 2, "exitcode": -9,
                                              "signal": "SIGKILL", "seen_at": None,
                                              "recorded_at": None, "host": None}]
    c = data["categories"]
    assert c["productive"] == near(30 * 0.9)
    assert c["data_wait"] == near(30 * 0.1)
    assert c["recomputed"] == near(5.0)
    assert c["initial_startup"] == near(4.0)
    assert c["evaluation"] == near(3 * (0.01 + 0.5))  # from the step's end: idle tail too
    assert c["checkpoint"] == near(0.75)
    assert c["stalled"] == 0
    assert data["steps"] == {"completed": 30, "unique": 30, "executed": 35, "recomputed": 5,
                             "target": 30, "unsaved": None, "typical_seconds": 1.0,
                             "stall_budget_seconds": 10.0}
    assert data["goodput_ratio"] == near(27.0 / data["time"]["wall_seconds"])
    assert data["effective_training_time_ratio"] == pytest.approx(
        30.0 / data["time"]["wall_seconds"])
    assert data["tokens"] == {"productive": 30 * 512 * 2, "processed": 35 * 512 * 2}
    assert [a["outcome"] for a in data["attempts"]] == ["interrupted", "finished"]
    assert data["state"] == "finished" and data["warnings"] == []



def test_a_lost_node_is_the_cause_of_the_attempt_it_ended(tmp_path):
    """4 ranks on 2 nodes; node n1 (ranks 2, 3) vanishes in step 15; torchrun on n0 goes on
    with 2 ranks. The leader journals node_lost 15 s after it fell silent, inside the next
    attempt; the incident of the attempt it ended names it, before the peers' failures.
    When n1 returns, torchrun stops the 2 ranks (they save on SIGTERM) to grow back to 4:
    that restart is named as the return, not as a stop on request."""
    r = Run(tmp_path / "run", world_size=4)
    r.attempt(0)
    r.rank_event("run_started", world_size=4, start_step=0, steps=30)
    r.steps(0, 14)
    lost_at = r.clock
    r.rank_event("failed", 0, error="RuntimeError: Connection closed by peer")
    r.wait(5)
    r.world_size = 2
    r.attempt(1)
    r.rank_event("checkpoint_resumed", step=10, path="checkpoints/step-00000010")
    r.wait(10)
    r.event("node_lost", "engine", at=lost_at + 15, node="n0", node_rank=0, nnodes=2,
            leader=True, lost_node="n1", ranks=[2, 3], silent_seconds=15.0)
    r.steps(10, 29)
    r.event("node_returned", "engine", node="n0", node_rank=0, nnodes=2, leader=True,
            lost_node="n1", lost_seconds=20.0)
    r.wait(0.5)
    r.rank_event("checkpoint_saved", step=30, reason="stop", mode="sync", blocking_seconds=0.1)
    r.wait(3)
    r.world_size = 4
    r.attempt(2)
    r.rank_event("checkpoint_resumed", step=30, path="checkpoints/step-00000030")
    r.steps(30, 39)
    r.rank_event("finished", step=39, steps=40)
    lost, grown = report_json(r.run.root)["incidents"]
    assert lost["cause"].startswith("node n1 lost (its supervisor and ranks 2, 3 fell "
                                    "silent)"), lost["cause"]
    assert lost["evidence"]["lost_nodes"] == [{"node": "n1", "ranks": [2, 3]}]
    assert grown["cause"] == ("node n1 returned: torchrun restarted the workers to take it "
                              "back in (a planned re-rendezvous); checkpoint saved at step 30 "
                              "as the workers were stopped"), grown["cause"]


def test_a_supervisor_killed_with_its_job_is_said_not_a_stop_on_request(tmp_path):
    """`kill -9` of `trainwatch run`: its job stops with it (the ranks save on SIGTERM), and
    the next supervisor finds the lock its predecessor never released. The incident said
    "stopped on request" although nobody asked; it now names the death."""
    r = Run(tmp_path / "run")
    r.attempt(0)
    r.rank_event("run_started", world_size=2, start_step=0, steps=30)
    r.steps(0, 11)
    r.rank_event("checkpoint_saved", step=12, reason="stop", mode="sync", blocking_seconds=0.1)
    r.wait(30)
    r.event("supervisor_died", "supervisor", previous={"pid": 4242, "host": "h"},
            last_beat_at=T0 + r.clock - 29)
    r.wait(2)
    r.attempt(1)
    r.rank_event("checkpoint_resumed", step=12, path="checkpoints/step-00000012")
    r.steps(12, 29)
    r.rank_event("finished", step=29, steps=30)
    (incident,) = report_json(r.run.root)["incidents"]
    assert incident["cause"] == (
        "its supervisor (pid 4242) died without a word (SIGKILL, a crash or an OOM kill; "
        "found by the next supervisor): the job stopped with it; checkpoint saved at step 12 "
        "as the workers were stopped"), incident["cause"]
    assert incident["evidence"]["supervisor_died"][0]["pid"] == 4242

def clean_run(root, *, steps, before, seconds, after, ready=0.0) -> "Run":
    """A run without incident: launched, its ranks up ``before`` s later (and ``ready`` s
    more before the first step), ``steps`` steps of ``seconds`` s, the launcher exiting
    ``after`` s after the last."""
    r = Run(root, steps=steps)
    r.event("launcher_started", "launcher", pid=1)
    r.wait(before)
    r.attempt(0)
    r.rank_event("run_started", world_size=2, start_step=0, steps=steps)
    r.wait(ready)
    r.steps(0, steps - 1, seconds=seconds, data_wait=0.0)
    r.rank_event("finished", step=steps - 1, steps=steps)
    r.wait(after)
    r.event("launcher_exited", "launcher", exit_code=0)
    return r


def test_a_clean_run_has_no_incident_and_nothing_recomputed(tmp_path):
    r = clean_run(tmp_path / "run", steps=10, before=1.5, ready=0.5, seconds=0.5, after=1)
    data = report_json(r.run.root)
    assert_sums_to_wall(data)
    assert data["incidents"] == [] and data["steps"]["recomputed"] == 0
    assert data["categories"]["recomputed"] == 0 == data["categories"]["restart_downtime"]
    assert data["goodput_ratio"] == near(5.0 / 8.0)
    assert data["categories"]["shutdown"] == near(1.0)   # after the last step
    assert data["categories"]["other"] == near(0.0)
    assert data["checkpoint_hint"] is None
    assert "no incidents" in report(r.run.root).stdout


def test_a_long_step_is_stalled_beyond_the_typical_step(tmp_path):
    r = Run(tmp_path / "run", steps=20)
    r.attempt(0)
    r.steps(0, 19, seconds=0.2, data_wait=0.0, slow={7: 30.0})
    r.wait(12)                                     # hung between steps, then carried on
    r.steps(20, 21, seconds=0.2, data_wait=0.0)
    r.rank_event("finished", step=21, steps=22)
    data = report_json(r.run.root)
    assert_sums_to_wall(data)
    # typical 0.2 s, budget max(5, 10 x 0.2) = 5 s: step 7 is 29.8 s stalled, the gap 12 s.
    assert data["steps"]["stall_budget_seconds"] == near(5.0)
    assert data["categories"]["stalled"] == near(29.8 + 12.0)
    assert data["categories"]["productive"] == near(22 * 0.2)
    assert data["incidents"] == []


def test_a_stall_restart_by_the_controller_is_charged_to_its_incident(tmp_path):
    r = Run(tmp_path / "run", steps=10, every=3)
    r.event("controller_started", "engine")
    r.event("job_started", "engine", pid=50, reason="trainwatch run", attempt=1)
    r.event("launcher_started", "launcher", pid=50)    # the job is `trainwatch train`
    r.wait(1)
    r.attempt(0)
    r.rank_event("run_started", world_size=2, start_step=0, steps=10)
    r.wait(1)
    r.steps(0, 2)
    r.save(3, 0.5)
    r.steps(3, 4)
    hung_from = r.clock
    r.wait(13)
    r.event("alert_firing", "engine", alert="TrainingStalled", severity="critical")
    r.wait(1)
    r.event("action_taken", "engine", action="stall_restart", alert="TrainingStalled",
            reason="restarted a stalled job")
    r.wait(2)
    killed_at = r.clock
    r.event("job_stopped", "engine", pid=50, reason="stall", returncode=-9, hard=True)
    r.event("job_started", "engine", pid=60, reason="stall_restart", attempt=2)
    r.event("launcher_started", "launcher", pid=60)
    r.wait(2)
    r.attempt(0)                                   # a new torchrun: restart count 0 again
    r.rank_event("checkpoint_resumed", step=3)
    r.rank_event("run_started", world_size=2, start_step=3, steps=10)
    r.wait(1)
    first_step_at = r.clock
    r.steps(3, 9)
    r.rank_event("finished", step=9, steps=10)
    r.event("launcher_exited", "launcher", exit_code=0)
    r.event("job_exited", "engine", returncode=0, pid=60)
    r.event("controller_stopped", "engine", exit_code=0)
    data = report_json(r.run.root, "--gpu-hour-price", "4", "--gpus", "8")
    assert_sums_to_wall(data)
    assert data["time"]["not_running_seconds"] == 0        # the controller held the job
    (incident,) = data["incidents"]
    assert incident["cause"].startswith("stall_restart by the controller (TrainingStalled)")
    assert incident["evidence"]["alerts"] == ["TrainingStalled"]
    assert incident["steps_lost"] == 2                       # steps 3 and 4, after the save of 3
    assert incident["stalled_seconds"] == near(killed_at - hung_from)
    assert incident["restart_downtime_seconds"] == near(first_step_at - killed_at)
    assert incident["cost"] == near(incident["total_seconds"] / 3600 * 8 * 4)
    assert data["categories"]["stalled"] == near(killed_at - hung_from)


def test_a_stopped_run_relaunched_later_is_not_billed_for_the_pause(tmp_path):
    r = Run(tmp_path / "run", steps=10)
    r.event("launcher_started", "launcher", pid=1)
    r.wait(1)
    r.attempt(0)
    r.rank_event("run_started", world_size=2, start_step=0, steps=10)
    r.steps(0, 4)
    r.rank_event("checkpoint_requested", step=5, sources=["SIGTERM"], stop=True)
    r.save(5, 0.5, reason="stop")
    r.wait(1)
    stopped = r.clock
    r.event("launcher_exited", "launcher", exit_code=143, signal="SIGTERM")
    r.wait(3600)
    relaunched = r.clock
    r.event("launcher_started", "launcher", pid=2)
    r.wait(2)
    r.attempt(0)
    r.rank_event("checkpoint_resumed", step=5)
    r.rank_event("run_started", world_size=2, start_step=5, steps=10)
    first = r.clock
    r.steps(5, 9)
    r.rank_event("finished", step=9, steps=10)
    r.event("launcher_exited", "launcher", exit_code=0)
    data = report_json(r.run.root)
    assert_sums_to_wall(data)
    assert data["time"]["not_running_seconds"] == near(relaunched - stopped)
    (incident,) = data["incidents"]
    assert incident["outcome"] == "stopped" and incident["steps_lost"] == 0
    assert "stopped on request, checkpoint saved at step 5" in incident["cause"]
    assert incident["restart_downtime_seconds"] == near(1.0 + (first - relaunched))
    assert data["categories"]["recomputed"] == 0
    assert data["checkpoint_hint"] is None                  # a stop is not a failure


def test_a_controller_session_killed_hard_then_relaunched_later_is_a_pause(tmp_path):
    """Ctrl-C on `trainwatch run` with a hung job: the launcher is SIGKILLed (no
    launcher_exited); job_stopped says it is gone. A plain relaunch an hour later."""
    r = Run(tmp_path / "run", steps=6)
    r.event("controller_started", "engine")
    r.event("job_started", "engine", pid=50, reason="trainwatch run", attempt=1)
    r.event("launcher_started", "launcher", pid=50)
    r.attempt(0)
    r.rank_event("run_started", world_size=2, start_step=0, steps=6)
    r.steps(0, 2)
    r.save(3, 0.1)
    r.wait(1)
    r.event("job_stopped", "engine", pid=50, reason="interrupted", returncode=-9, hard=True)
    r.wait(0.5)
    r.event("controller_stopped", "engine", exit_code=130, interrupted=True)
    r.wait(3600)
    r.event("launcher_started", "launcher", pid=70)
    r.attempt(0)
    r.rank_event("checkpoint_resumed", step=3)
    r.steps(3, 5)
    r.rank_event("finished", step=5, steps=6)
    r.event("launcher_exited", "launcher", exit_code=0)
    data = report_json(r.run.root)
    assert_sums_to_wall(data)
    assert data["time"]["not_running_seconds"] == near(3600)
    (incident,) = data["incidents"]
    assert incident["steps_lost"] == 0 and incident["restart_downtime_seconds"] == near(1.5)


def test_a_rollback_loses_the_skipped_steps_too(tmp_path):
    """A NaN at step 23: the controller rolls back to the save of step 20 and the trainer skips
    steps 23-24. Their first executions were thrown away although they never ran again."""
    r = Run(tmp_path / "run", steps=30)
    r.event("controller_started", "engine")
    r.event("launcher_started", "launcher", pid=1)
    r.attempt(0)
    r.rank_event("run_started", world_size=2, start_step=0, steps=30)
    r.steps(0, 9)
    r.save(10, 0.1)
    r.steps(10, 19)
    r.save(20, 0.1)
    r.steps(20, 22)
    r.rank_event("nonfinite_detected", step=23, action="skipped")
    r.steps(23, 24)
    r.event("alert_firing", "engine", alert="TrainingLossNonFinite")
    r.event("action_taken", "engine", action="rollback_skip", alert="TrainingLossNonFinite",
            reason="rolled back")
    r.wait(1)
    r.event("job_stopped", "engine", pid=1, reason="rollback", returncode=-9)
    r.event("launcher_started", "launcher", pid=2)
    r.wait(1)
    r.attempt(0)
    r.rank_event("checkpoint_resumed", step=20)
    r.rank_event("run_started", world_size=2, start_step=20, steps=30)
    r.steps(20, 22)
    r.rank_event("data_skipped", from_step=23, to_step=24)
    r.steps(25, 29)
    r.rank_event("finished", step=29, steps=30)
    r.event("controller_stopped", "engine", exit_code=0)
    data = report_json(r.run.root)
    assert_sums_to_wall(data)
    (incident,) = data["incidents"]
    assert incident["lost_steps"] == {"first": 20, "last": 24} and incident["steps_lost"] == 5
    assert incident["evidence"]["nonfinite_steps"] == [23]
    assert "rollback_skip" in incident["cause"]
    assert data["steps"]["unique"] == 28                     # 23 and 24 were skipped
    assert data["categories"]["recomputed"] == near(5.0)


def test_a_rollback_of_an_attempt_that_had_finished_its_steps_is_an_incident(tmp_path):
    """A short run: the loss went NaN at step 15, every rank finished step 29, and while
    torchrun was still on its way out the NaN alert's rollback killed it and ran steps 10-29
    again. That attempt's work was thrown away by the rollback: an incident with its cause,
    not "no incidents: every attempt ran to its end"."""
    r = Run(tmp_path / "run", steps=30)
    r.event("controller_started", "engine")
    r.event("job_started", "engine", pid=1, attempt=1)
    r.attempt(0)
    r.steps(0, 9)
    r.save(10, 0.1)
    r.steps(10, 29)
    r.rank_event("finished", step=29, steps_completed=30)
    r.wait(2)
    r.event("alert_firing", "engine", alert="TrainingLossNonFinite")
    r.event("job_stopped", "engine", pid=1, reason="rollback_skip (TrainingLossNonFinite)",
            returncode=-9, hard=True)
    r.event("job_started", "engine", pid=2, attempt=2)
    r.event("action_taken", "engine", action="rollback_skip", alert="TrainingLossNonFinite",
            reason="rollback_skip: restarted the job", pid=2)
    r.wait(5)
    r.attempt(0)
    r.rank_event("checkpoint_resumed", step=10)
    r.steps(10, 29)
    r.rank_event("finished", step=29, steps_completed=30)
    r.wait(1)
    r.event("job_exited", "engine", pid=2, returncode=0)
    r.event("controller_stopped", "engine", exit_code=0)
    data = report_json(r.run.root)
    assert_sums_to_wall(data)
    (incident,) = data["incidents"]
    assert "rollback_skip by the controller (TrainingLossNonFinite)" in incident["cause"]
    assert data["state"] == "finished"
    assert data["categories"]["recomputed"] == near(20.0)


def test_a_run_that_gave_up_reports_every_attempt_and_its_unsaved_steps(tmp_path):
    r = Run(tmp_path / "run", steps=30)
    r.event("launcher_started", "launcher", pid=1)
    pids = r.attempt(0)
    r.steps(0, 12)
    r.save(10, 0.1)  # journaled late (async), for step 10
    r.rank_event("failed", 1, error="RuntimeError: boom")
    r.torchrun_failed(pids[1], 1, 3)
    r.wait(2)
    r.attempt(1)
    r.rank_event("checkpoint_resumed", step=10)
    r.rank_event("restarted", restart_count=1, world_size=2, start_step=10, steps=30)
    r.steps(10, 11)
    r.rank_event("failed", 0, error="RuntimeError: boom again")
    r.wait(1)
    r.event("launcher_exited", "launcher", exit_code=1)
    data = report_json(r.run.root)
    assert_sums_to_wall(data)
    assert data["state"] == "ended"
    assert [i["outcome"] for i in data["incidents"]] == ["interrupted", "ended"]
    assert data["incidents"][0]["cause"] == "rank 1 exited with code 3"
    assert data["incidents"][0]["steps_lost"] == 3               # 10, 11, 12
    assert data["incidents"][1]["cause"] == "rank 0 failed: RuntimeError: boom again"
    assert data["incidents"][1]["restart_downtime_seconds"] == 0  # nothing restarted it
    assert data["steps"]["unsaved"] == 2                         # 10 and 11, after the save
    # The failure and teardown after the last step end the run: shutdown, not "other"
    # (a real run that gave up: 1.83 s of 24.3 s were "other").
    assert data["categories"]["shutdown"] == near(1.0)
    assert data["categories"]["other"] == near(0.0)


# --------------------------------------------------------------------------- bad input

def test_torn_and_alien_lines_are_skipped_counted_and_shown(tmp_path):
    r, _, _ = crash_and_restart(tmp_path)
    with open(r.run.journal_file, "a") as fh:
        fh.write('{"v": 1, "time": 1800000100.0, "event": "launcher_exi')      # torn
        fh.write("\n[1, 2]\n")                                                   # not an object
        fh.write('{"v": 1, "event": "alien_without_time"}\n')
        fh.write('{"v": 99, "time": 1800000100.0, "event": "from_the_future"}\n')
    with open(r.run.metrics_file(0), "a") as fh:
        fh.write('{"v": 1, "kind": "step", "step": 3\n')                          # torn
        fh.write('{"v": 1, "kind": "step", "step": "x", "time": 1.0}\n')        # alien
        fh.write('{"v": 1, "kind": "step", "step": 40, "time": 1800000050.0}\n')  # no timing
    data = report_json(r.run.root)
    assert data["skipped"]["journal_lines"] == 4
    assert data["skipped"]["metrics_lines"] == 3
    assert len(data["incidents"]) == 1 and data["steps"]["unique"] == 30
    assert_sums_to_wall(data)
    text = report(r.run.root).stdout
    assert "skipped 4 journal line(s) and 3 metrics line(s)" in text
    assert "torn or not JSON" in text


def test_alien_field_values_never_crash_the_report(tmp_path):
    """Valid JSON with the wrong types where numbers, names and steps belong."""
    r, _, _ = crash_and_restart(tmp_path)
    weird = [
        {"v": 1, "time": "noon", "event": "failed", "source": "rank0"},
        {"v": 1, "time": float("nan"), "event": "failed", "source": "rank0"},
        {"v": 1, "time": T0 + 5, "event": "rank_started", "source": "rankX", "rank": "zero",
         "pid": "p", "restart_count": "many"},
        {"v": 1, "time": T0 + 6, "event": "checkpoint_saved", "source": "rank0", "step": 3.5,
         "blocking_seconds": "slow"},
        {"v": 1, "time": T0 + 7, "event": "checkpoint_saved", "source": "rank0", "step": 4,
         "blocking_seconds": -3, "mode": ["async"]},
        {"v": 1, "time": T0 + 8, "event": "alert_firing", "source": "engine", "alert": None},
        {"v": 1, "time": T0 + 9, "event": "failed", "source": "rank1", "error": {"a": 1}},
        {"v": 1, "time": T0 + 9, "event": "fault_injected", "source": "rank1", "step": [1]},
        {"v": 1, "time": T0 + 9, "event": 7, "source": "rank1"},
    ]
    for record in weird:
        append_jsonl(r.run.journal_file, record)
    append_jsonl(r.run.metrics_file(0), {"v": 1, "kind": "step", "step": 99, "time": T0 + 9,
                                         "step_time_seconds": float("inf")})
    append_jsonl(r.run.metrics_file(0), {"v": 1, "kind": "step", "step": 98, "time": T0 + 9,
                                         "step_time_seconds": 0.5, "tokens": "lots",
                                         "data_wait_seconds": -1})
    data = report_json(r.run.root)
    assert_sums_to_wall(data)
    assert data["skipped"]["journal_lines"] == 3                # no usable time or name
    assert data["skipped"]["metrics_lines"] == 1                # infinite step time
    assert data["tokens"]["productive"] is None                 # one step's tokens unknown
    report(r.run.root)                                          # and the text view


@pytest.mark.parametrize("setup, message", [
    (lambda p: None, "no such run directory"),
    (lambda p: p.mkdir(), "not a trainwatch run directory"),
    (lambda p: (p.mkdir(), (p / "run.json").write_text('{"format": "other"}')),
     "nothing to report"),
])
def test_bad_run_directories_exit_2_with_a_clear_message(tmp_path, setup, message):
    path = tmp_path / "run"
    setup(path)
    done = report(path, expect=2)
    assert message in done.stderr and str(path) in done.stderr


@pytest.mark.parametrize("config, key", [
    ("gpu_hour_price: -1\n", "gpu_hour_price"),
    ("gpu_hour_price: cheap\n", "gpu_hour_price"),
    ("gpus: 0\n", "gpus"),
    ("accelerators_per_rank: 1.5\n", "accelerators_per_rank"),
    ("gpus: 2\naccelerators_per_rank: 1\n", "gpus"),
    ("price: 3\n", "price"),
    ("gpu_hour_price: [1\n", None),
])
def test_bad_cost_config_exits_2_naming_file_and_key(tmp_path, config, key):
    r, _, _ = crash_and_restart(tmp_path)
    path = tmp_path / "cost.yaml"
    path.write_text(config)
    done = report(r.run.root, "--config", str(path), expect=2)
    assert str(path) in done.stderr
    assert (f"key '{key}'" if key else "invalid YAML") in done.stderr


def test_a_negative_price_on_the_command_line_is_bad_usage(tmp_path):
    r, _, _ = crash_and_restart(tmp_path)
    assert "--gpu-hour-price" in report(r.run.root, "--gpu-hour-price", "-2", expect=2).stderr


# --------------------------------------------------------------------------- cost and output

def test_cost_per_category_failures_and_tokens(tmp_path):
    r, _, _ = crash_and_restart(tmp_path)
    config = tmp_path / "cost.yaml"
    config.write_text("gpu_hour_price: 3.0\naccelerators_per_rank: 4\n")
    data = report_json(r.run.root, "--config", str(config))
    cost, wall = data["cost"], data["time"]["wall_seconds"]
    assert cost["accelerators"] == 8 and cost["gpu_hour_price"] == 3.0
    assert cost["total"] == near(wall / 3600 * 8 * 3.0)
    assert sum(cost["by_category"].values()) == near(cost["total"])
    failures = sum(data["categories"][c] for c in ("recomputed", "restart_downtime", "stalled"))
    assert cost["failures"] == near(failures / 3600 * 8 * 3.0)
    assert cost["per_million_tokens"] == pytest.approx(
        cost["total"] / (data["tokens"]["productive"] / 1e6))
    # The command line wins over the file.
    assert report_json(r.run.root, "--config", str(config), "--gpu-hour-price", "1",
                       "--gpus", "2")["cost"]["total"] == near(wall / 3600 * 2)
    without = report_json(r.run.root)["cost"]
    assert without["total"] is None and without["per_million_tokens"] is None
    assert without["accelerator_hours"] == near(wall / 3600 * 2)


def test_the_checkpoint_hint_follows_young_daly_from_the_runs_own_numbers(tmp_path):
    r, _, _ = crash_and_restart(tmp_path)
    data = report_json(r.run.root)
    hint = data["checkpoint_hint"]
    wall = data["time"]["wall_seconds"]
    assert hint["failures"] == 1 and hint["mtbf_seconds"] == near(wall)
    assert hint["save_blocking_seconds"] == near(0.25)
    assert hint["current_every_steps"] == 10
    assert hint["suggested_every_steps"] == round((2 * 0.25 * wall) ** 0.5 / 1.0)


def test_world_size_is_cross_checked_against_the_ranks(tmp_path):
    r, _, _ = crash_and_restart(tmp_path)
    info = json.loads(r.run.run_file.read_text())
    r.run.write_run_info({**{k: v for k, v in info.items() if k not in ("format", "version")},
                          "world_size": 4})
    warnings = report_json(r.run.root)["warnings"]
    assert "run.json says world size 4, rank 0 of the newest attempt reported 2" in warnings
    r.rank_event("restarted", restart_count=2, world_size=3, start_step=30, steps=30)
    warnings = report_json(r.run.root)["warnings"]
    assert "attempt 1: 2 of 3 ranks journaled rank_started" in warnings
    assert "2 rank metrics logs for a world size of 3" in warnings


def test_each_attempt_is_priced_at_its_own_world_size(tmp_path):
    """2 ranks, rank 1 lost at step 15; the job resumes from step 10 on 1 rank, whose steps
    train twice the tokens per rank (the same global batch). Before: the whole run billed
    at run.json's world size 1 and tokens counted as rank 0's x 1."""
    r = Run(tmp_path / "run")
    r.attempt(0)
    r.rank_event("run_started", world_size=2, start_step=0, steps=20)
    r.steps(0, 14)
    r.rank_event("failed", 0, error="RuntimeError: Connection reset by peer")
    r.wait(3)
    r.world_size = 1
    r.run.write_run_info({"job": "synth", "world_size": 1, "nproc_per_node": 1})
    r.attempt(0)
    r.rank_event("run_started", world_size=1, start_step=10, steps=20)
    r.steps(10, 19, tokens=1024)
    r.rank_event("finished", step=19, steps=20)
    data = report_json(r.run.root, "--gpu-hour-price", "3600")
    first, second = data["attempts"]
    assert (first["world_size"], second["world_size"], data["world_size"]) == (2, 1, 1)
    assert first["wall_seconds"] + second["wall_seconds"] == near(data["time"]["wall_seconds"])
    held = first["wall_seconds"] * 2 + second["wall_seconds"]
    assert data["cost"]["total"] == near(held) and first["cost"] == near(first["wall_seconds"] * 2)
    assert data["cost"]["accelerators_source"] == ("world size 2 -> 1 x 1 per rank, each "
                                                   "attempt at its own")
    assert data["tokens"]["productive"] == 10 * 512 * 2 + 10 * 1024  # steps 0-9, then 10-19
    assert data["warnings"] == []
    assert "world size 2 -> 1" in report(r.run.root).stdout


def test_prom_textfile_passes_promtool_and_uses_only_contract_names(tmp_path):
    r, _, _ = crash_and_restart(tmp_path)
    out = tmp_path / "textfile" / "trainwatch_report.prom"
    out.parent.mkdir()
    data = report_json(r.run.root, "--prom-textfile", str(out))
    text = out.read_text()
    names = set(re.findall(r"^(trainwatch_[a-z_]+)[{ ]", text, re.M))
    assert names and names <= {n for n in METRICS if n.startswith("trainwatch_cost_")}
    assert 'trainwatch_cost_incidents{run="synth"} 1.0' in text
    assert re.search(r'trainwatch_cost_badput_seconds\{category="recomputed",run="synth"\} 5\.0',
                     text)
    goodput = float(re.search(r"^trainwatch_cost_goodput_ratio\S* (\S+)$", text, re.M)[1])
    assert goodput == near(data["goodput_ratio"])
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed")
    check = subprocess.run(["promtool", "check", "metrics"], input=text.encode(),
                           capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_every_json_key_is_documented(tmp_path):
    """docs/report.md names (in backticks) every key a report with an incident carries."""
    r, _, _ = crash_and_restart(tmp_path)
    data = report_json(r.run.root, "--gpu-hour-price", "1")
    docs = DOCS.read_text()
    keys = set(data)
    for section in ("time", "categories", "steps", "tokens", "cost", "checkpoint_hint",
                    "skipped"):
        keys |= set(data[section])
    keys |= set(data["attempts"][0]) | set(data["incidents"][0])
    keys |= set(data["incidents"][0]["evidence"])
    assert {k for k in keys if f"`{k}`" not in docs} == set()


def _long_run(root: Path, steps: int) -> Path:
    """A run of ``steps`` steps with a restart that recomputes 100 of them, written fast."""
    run = RunDir(root).create()
    run.write_run_info({"job": "long", "world_size": 1, "nproc_per_node": 1})
    lines, t = [], T0 + 1.0
    journal = [{"v": 1, "time": T0, "event": "rank_started", "source": "rank0", "rank": 0,
                "pid": 1, "restart_count": 0}]
    for i, step in enumerate([*range(steps // 2), *range(steps // 2 - 100, steps)]):
        if i == steps // 2:
            t += 5.0
            journal.append({"v": 1, "time": t, "event": "rank_started", "source": "rank0",
                            "rank": 0, "pid": 2, "restart_count": 1})
            t += 1.0
        t += 0.1
        lines.append(json.dumps({"v": 1, "kind": "step", "step": step, "time": t, "rank": 0,
                                 "step_time_seconds": 0.09, "data_wait_seconds": 0.001,
                                 "loss": 2.5, "tokens": 512, "phase_seconds": {"forward": 0.05,
                                 "backward": 0.03}, "memory_bytes": 1 << 30}))
    run.metrics_file(0).write_text("\n".join(lines) + "\n")
    run.journal_file.write_text("".join(json.dumps(e) + "\n" for e in journal))
    return run.root


def test_report_streams_the_metrics_log(tmp_path):
    """Memory grows by a few dozen bytes a step (columns), not by a record and objects per
    step: the peak of reading and accounting 20,000 steps is within ~100 bytes a step of
    reading 2,000 (it was ~3 KiB a step)."""
    import tracemalloc

    from trainwatch.report import cost, goodput, render, timeline

    def peak(steps: int) -> tuple[int, dict]:
        root = _long_run(tmp_path / str(steps), steps)
        tracemalloc.start()
        try:
            tl = timeline.read_timeline(RunDir(root))
            data = render.report(tl, goodput.account(tl), cost.CostSettings())
            return tracemalloc.get_traced_memory()[1], data
        finally:
            tracemalloc.stop()

    small, _ = peak(2_000)
    large, data = peak(20_000)
    assert data["steps"]["executed"] == 20_100 and data["steps"]["recomputed"] == 100
    assert data["steps"]["unique"] == 20_000
    per_step = (large - small) / 18_100
    assert per_step < 100, f"{per_step:.0f} bytes of peak memory per step"


class SkewedRun(Run):
    """A Run whose rank 0 reads a wall clock ``behind`` seconds slow; every writer records its
    monotonic clock (one machine, one boot) beside the wall time, as RunDir.append_event does."""

    def __init__(self, root: Path, behind: float, **kw):
        super().__init__(root, **kw)
        self.behind = behind

    def event(self, name, source, at=None, **fields):
        when = self.clock if at is None else at
        skew = self.behind if source == "rank0" else 0.0
        append_jsonl(self.run.journal_file, {"v": 1, "time": T0 + when - skew, "mono": 500.0 + when,
                                             "event": name, "source": source, "host": "h",
                                             "boot": "b1", **fields})

    def steps(self, first, last, **kw):
        start = len(self.run.metrics(0).records)
        super().steps(first, last, **kw)
        lines = self.run.metrics(0).records  # rank 0's own log is on its own clock too
        for line in lines[start:]:
            line["time"] -= self.behind
        self.run.metrics_file(0).write_text("".join(json.dumps(x) + "\n" for x in lines))


def _clean_run(run):
    run.event("launcher_started", "launcher", pid=1)
    run.wait(2)
    run.attempt(0)
    run.rank_event("run_started", world_size=2, start_step=0, steps=30)
    run.wait(1)
    run.steps(0, 29, gap=0.01)
    run.rank_event("finished", step=29)
    run.wait(0.5)
    run.event("launcher_exited", "launcher", pid=1, returncode=0)


@pytest.mark.parametrize("behind", [300.0, -300.0])
def test_a_rank_clock_off_by_5_min_is_read_on_its_machines_clock(tmp_path, behind):
    """Rank 0's wall clock disagrees with the launcher's by 5 min: the journal's monotonic
    readings put it back, so the report matches the same run with agreeing clocks (it took
    the skew into the wall time: 30 s became 5 min 33 s)."""
    _clean_run(SkewedRun(tmp_path / "skewed", behind))
    _clean_run(SkewedRun(tmp_path / "agreed", 0.0))
    skewed, agreed = report_json(tmp_path / "skewed"), report_json(tmp_path / "agreed")
    assert_sums_to_wall(skewed)
    assert skewed["time"]["wall_seconds"] == pytest.approx(agreed["time"]["wall_seconds"],
                                                           abs=1e-3)
    assert agreed["time"]["wall_seconds"] < 40
    assert skewed["categories"] == pytest.approx(agreed["categories"], abs=1e-3)
    assert any("rank0's wall clock is 300.0 s" in w for w in skewed["warnings"])


def test_accounting_a_long_run_needs_little_beyond_its_step_log(tmp_path):
    """Accounting reads the steps back a chunk at a time (report/steplog.py): its peak is a
    few MiB of chunks whatever the run's length, not bytes per step (a 1M-step run with
    200 restarts had peaked at ~60 MiB above its log; tests/report/test_report_steplog.py
    holds the whole report flat in the number of steps)."""
    import tracemalloc

    from trainwatch.report import goodput, timeline

    tl = timeline.read_timeline(RunDir(_long_run(tmp_path, 200_000)))
    tracemalloc.start()
    try:
        acc = goodput.account(tl)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (acc.executed_steps, acc.recomputed_steps, acc.unique_steps) == (200_100, 100, 200_000)
    assert acc.productive_tokens == 512 * 200_000  # world size 1: job-wide = rank 0
    assert peak < 5 * 2**20, f"{peak / 2**20:.1f} MiB of peak memory to account"


def test_a_short_runs_low_goodput_says_it_is_start_up_and_shutdown(tmp_path):
    """Six quick steps after a long start: goodput is low for a reason the text says."""
    short = clean_run(tmp_path / "short", steps=6, before=8.0, seconds=0.2, after=3.0)
    text = report(short.run.root).stdout
    assert "start-up and shutdown take 9" in text and "fixed costs" in text, text
    long = clean_run(tmp_path / "long", steps=100, before=1.0, seconds=0.2, after=0.0)
    assert "fixed costs" not in report(long.run.root).stdout


def test_the_data_wait_row_says_it_is_outside_productive_time(tmp_path):
    """Data wait is badput (goodput excludes it), a row of its own: its label must not read
    as part of "productive", which the row above it is."""
    text = report(clean_run(tmp_path / "run", steps=6, before=1.0, seconds=0.2,
                            after=0.5).run.root).stdout
    assert "in productive steps" not in text, text
    assert "waiting for data (steps' data phase, not productive)" in text, text


def test_a_crash_with_no_rank_evidence_is_said_in_words_not_as_a_journal_event(tmp_path):
    """The job exited 1 and nothing names a rank (no torchrun line, no failed status): the
    cause says the job exited with code 1 and where to look, not 'job_exited with exit
    code 1'."""
    r = Run(tmp_path / "run")
    r.event("job_started", "engine", pid=7, reason="trainwatch run", attempt=1)
    r.wait(1.0)
    r.attempt(0)
    r.steps(0, 4, seconds=0.5)
    r.event("job_exited", "engine", returncode=1, pid=7)
    causes = [i["cause"] for i in report_json(r.run.root)["incidents"]]
    assert causes == ["the job exited with code 1; no rank's failure was recorded (its log: "
                      "logs/job.log)"], causes
