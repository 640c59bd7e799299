"""`trainwatch run` with default stall budgets must never harm a healthy job.

One real 2-rank run of the reference trainer serves two faults nobody scripted for the
safety net: its whole run directory lives on a small real tmpfs that the test fills to
the brim while it trains (status, metrics, journal, logs, checkpoints; the rank prints a
progress line every step), and rank 0 alone evaluates for 30 s after step 30 while rank 1
waits in the next collective. The job must train to the end with the same two rank
processes, no restart, no stall verdict and no stall alert; TrainwatchCannotPublish must
page within 30 s of the disk filling and StorageFull page too; the run finishes (exit 0)
once space returns. A second, short run, started beside the first (both mostly wait), hangs
inside that evaluation: the stall is still caught once the phase budget is spent.

Why 30 s of evaluation proves what 90 s did: a waiting rank judged by its own budget
(max(floor 5 s, 10 x 0.25 s steps)) would be a stall finding after 5 s, TrainingStallSuspected
acts on the next 5 s tick, and TrainingStalled pages after ``stall_for``, set to 10 s here
(1 m by default, which the 90 s had to outlast): every wrong verdict shows within 20 s.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from conftest import fill_to_the_brim, kill_tree, tmpfs_mount
from side_by_side import side_by_side
from control_helpers import fill_run_dir_and_logs, start_run
from trainwatch.rundir.run_dir import RunDir

pytestmark = pytest.mark.slow


def _start(tmp_path, run_dir, fault, *extra):
    (tmp_path / "train.yaml").write_text(
        "train: {steps: 60, batch_size: 4, eval_interval: 1000, milestone_interval: 1}\n"
        "checkpoint: {every_steps: 20, fsync: false}\n")
    return start_run(tmp_path, run_dir, *extra, env={"TRAINWATCH_FAULT": fault})


def _agent_status(run: RunDir) -> dict | None:
    started = run.events("controller_started")
    if not started or not started[-1].get("agent"):
        return None
    try:
        with urllib.request.urlopen(f"http://{started[-1]['agent'][0]}/status",
                                    timeout=5) as resp:
            return json.loads(resp.read())
    except OSError:
        return None


def _step(run: RunDir, rank: int) -> int:
    for s in run.statuses().records:
        if s["rank"] == rank and isinstance(s.get("step"), int):
            return s["step"]
    return -1


def _explain(finding: dict, status: dict, filled_at: float) -> dict:
    """A stall finding with what the agent saw of every rank of its job when it judged."""
    views = [{k: r.get(k) for k in (
                "rank", "step", "phase", "progress_age_seconds", "phase_age_seconds",
                "heartbeat_age_seconds", "stall")}
             | {"process": (r.get("process") or {}).get("status")}
             for job in status.get("jobs", []) if job.get("job") == finding["job"]
             for r in job["ranks"]]
    return {**{k: finding.get(k) for k in (
                "rank", "stall_kind", "phase", "step", "stalled_seconds", "budget_seconds",
                "message")},
            "detected_after_fill_s": round(finding.get("detected_at", 0) - filled_at, 1),
            "ranks_seen": views}


def _ranks_seen(status: dict | None) -> dict[int, dict]:
    return {r["rank"]: r for job in (status or {}).get("jobs", []) for r in job["ranks"]}


def _a_full_run_directory_and_a_30s_rank0_evaluation_do_not_harm_the_job(tmp_path):
    """Before (the whole run directory full): rank 0's progress print to its torchrun log
    file died of ENOSPC about a second after the disk filled, torchrun's restart the same
    way, and `trainwatch run` exited 1."""
    run = RunDir(tmp_path / "exp")
    (tmp_path / "thresholds.yaml").write_text("stall_for: 10s\n")
    with tmpfs_mount(run.root, "48m"):
        proc = _start(tmp_path, run.root, "slow:delay=0.25,eval:rank=0:step=30:seconds=30",
                      "--thresholds", str(tmp_path / "thresholds.yaml"))
        try:
            deadline = time.time() + 300
            while _step(run, 1) < 8 and time.time() < deadline and proc.poll() is None:
                time.sleep(0.2)
            assert _step(run, 1) >= 8, (tmp_path / "run.log").read_text()[-3000:]
            pids = {s["rank"]: s["pid"] for s in run.statuses().records}
            fill_run_dir_and_logs(run)
            filled_at, freed_at = time.time(), None
            budgets, stalls, pages = [], [], {}
            while proc.poll() is None and time.time() < filled_at + 400:
                if freed_at is None:
                    fill_to_the_brim(run.root)  # kept full: the job frees what it gives up
                status = _agent_status(run)
                ranks = _ranks_seen(status)
                r1, r0 = ranks.get(1, {}), ranks.get(0, {})
                if r1.get("phase") not in (None, "eval") and r0.get("phase") == "eval":
                    budgets.append((r1.get("stall") or {}).get("budget_seconds"))
                stalls += [_explain(f, status, filled_at)
                           for f in (status or {}).get("findings", []) if f["kind"] == "stall"]
                log = (tmp_path / "run.log").read_text()
                for alert in ("TrainwatchCannotPublish", "StorageFull"):
                    if f"alert {alert} firing" in log:
                        pages.setdefault(alert, time.time() - filled_at)
                if freed_at is None and (r1.get("step") or 0) >= 40 and len(pages) == 2:
                    (run.root / "filler").unlink()  # the last save (step 60) has room
                    freed_at = time.time()
                time.sleep(0.5)
            code = proc.wait(timeout=120)
        finally:
            kill_tree(proc)
        log = (tmp_path / "run.log").read_text()
        statuses = {s["rank"]: s for s in run.statuses().records}
        firing = run.events("alert_firing")
        started, restarted = run.events("job_started"), run.events("restarted")
        journal = [(round(e["time"] - filled_at, 1), e.get("source"), e["event"],
                    e.get("reason") or e.get("returncode") or e.get("restart_count"))
                   for e in run.events() if e["event"] not in ("alert_firing", "alert_resolved")]
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    # the same two rank processes from before the disk filled to their finish
    assert {r: (s["pid"], s["state"]) for r, s in statuses.items()} == \
        {r: (pid, "finished") for r, pid in pids.items()}, log[-3000:]
    assert len(started) == 1 and not restarted, (journal, log[-3000:])
    assert pages.get("TrainwatchCannotPublish", 99) <= 30 and "StorageFull" in pages, \
        (pages, log[-3000:])
    assert not stalls, "\n".join(json.dumps(f, default=str) for f in stalls[:5])
    assert "alert TrainingStall" not in log, log[-3000:]
    assert not [e for e in firing if e.get("alert", "").startswith("TrainingStall")], firing
    # rank 1 waited on rank 0's evaluation and inherited its budget (300 s by default)
    assert budgets and max(b for b in budgets if b is not None) >= 300, budgets
    print(f"pages after the disk filled: {pages}; {len(budgets)} looks at rank 1 waiting "
          "on rank 0's evaluation")


# Above the 5 s floor a rank's own budget would give (10 x 0.2 s steps is less) by enough
# that a rank judged by the floor, not the evaluation's budget, shows before it.
EVAL_BUDGET = 10


def _a_hang_inside_the_evaluation_is_caught_within_its_phase_budget(tmp_path):
    run = RunDir(tmp_path / "exp")
    (tmp_path / "agent.yaml").write_text(
        f"stall:\n  phase_budgets: {{checkpoint: 600, eval: {EVAL_BUDGET}, init: 600}}\n")
    proc = _start(tmp_path, run.root, "slow:delay=0.2,eval:rank=0:step=5",
                  "--agent-config", str(tmp_path / "agent.yaml"))
    try:
        # Each rank's finding as first seen: the early stall action may restart the job
        # (rank 0 then reads as dead) before the other rank's finding is up.
        found, deadline = {}, time.time() + 300
        while not {0, 1} <= set(found) and time.time() < deadline and proc.poll() is None:
            status = _agent_status(run) or {}
            for f in status.get("findings", []):
                if f["kind"] == "stall":
                    found.setdefault(f["rank"], f)
            time.sleep(0.5)
        injected = [e for e in run.events("fault_injected") if e.get("fault") == "eval"]
    finally:
        # Not Ctrl-C: rank 0 hangs in its evaluation and ignores SIGTERM, so a graceful stop
        # would wait out the 15 s grace before its SIGKILL, which nothing here looks at.
        kill_tree(proc)
    assert {0, 1} <= set(found), (found, (tmp_path / "run.log").read_text()[-3000:])
    events = [(e["event"], e.get("reason") or e.get("fault")) for e in run.events(
        "fault_injected", "job_started", "job_stopped", "job_exited", "alert_firing")]
    assert found[0]["phase"] == "eval" and found[0]["stall_kind"] == "stuck", (found, events)
    assert "waiting for rank 0 in eval" in found[1]["message"]
    began = injected[0]["time"]
    for rank in (0, 1):  # not before the evaluation's budget, and soon after it
        assert EVAL_BUDGET - 1 <= found[rank]["detected_at"] - began <= EVAL_BUDGET + 15, \
            (found, began)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The two runs side by side: both mostly wait (paced steps, an evaluation, a budget)."""
    with side_by_side(request, tmp_path_factory, {
        "test_a_full_run_directory_and_a_30s_rank0_evaluation_do_not_harm_the_job":
            _a_full_run_directory_and_a_30s_rank0_evaluation_do_not_harm_the_job,
        "test_a_hang_inside_the_evaluation_is_caught_within_its_phase_budget":
            _a_hang_inside_the_evaluation_is_caught_within_its_phase_budget,
    }) as running:
        yield running


def test_a_full_run_directory_and_a_30s_rank0_evaluation_do_not_harm_the_job(runs, request):
    runs.result(request)


def test_a_hang_inside_the_evaluation_is_caught_within_its_phase_budget(runs, request):
    runs.result(request)
