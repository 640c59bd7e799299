"""`trainwatch run` with default thresholds must never harm a healthy job.

One real 2-rank run serves two faults nobody scripted for the safety net: its `status/`
and `metrics/` live on small real tmpfs mounts that the test fills up while it trains, and
rank 0 alone evaluates for 90 s after step 30 while rank 1 waits in the next collective.
The job must train to the end with no restart, no stall verdict and no stall alert,
and TrainwatchCannotPublish must fire within 30 s of the disk filling. A second, short run
hangs inside that evaluation: the stall is still caught once the phase budget is spent.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.request

import pytest

from conftest import kill_tree, tmpfs_mount
from control_helpers import start_run
from trainwatch.rundir.run_dir import RunDir

pytestmark = pytest.mark.slow


def _start(tmp_path, run_dir, fault, *extra):
    (tmp_path / "train.yaml").write_text(
        "train: {steps: 60, batch_size: 4, eval_interval: 1000}\n"
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


def _fill(folder) -> None:
    chunk = b"\0" * 65536
    with open(folder / "filler", "wb") as fh:
        try:
            while True:
                fh.write(chunk)
                fh.flush()
        except OSError:
            pass


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


def test_full_disk_and_a_90s_rank0_evaluation_do_not_harm_the_job(tmp_path):
    run = RunDir(tmp_path / "exp")
    with tmpfs_mount(run.status_dir, "1m"), tmpfs_mount(run.metrics_dir, "1m"):
        proc = _start(tmp_path, run.root, "slow:delay=0.25,eval:rank=0:step=30:seconds=90")
        try:
            deadline = time.time() + 300
            while _step(run, 1) < 8 and time.time() < deadline and proc.poll() is None:
                time.sleep(0.2)
            assert _step(run, 1) >= 8, (tmp_path / "run.log").read_text()[-3000:]
            _fill(run.status_dir)
            _fill(run.metrics_dir)
            filled_at = time.time()
            budgets, stalls = [], []
            while proc.poll() is None and time.time() < filled_at + 400:
                status = _agent_status(run)
                for job in (status or {}).get("jobs", []):
                    for r in job["ranks"]:
                        if r["rank"] == 1 and r.get("phase") not in (None, "eval") and \
                                any(o["rank"] == 0 and o.get("phase") == "eval"
                                    for o in job["ranks"]):
                            budgets.append((r.get("stall") or {}).get("budget_seconds"))
                stalls += [_explain(f, status, filled_at)
                           for f in (status or {}).get("findings", []) if f["kind"] == "stall"]
                time.sleep(1)
            code = proc.wait(timeout=120)
        finally:
            kill_tree(proc)
    log = (tmp_path / "run.log").read_text()[-3000:]
    assert code == 0, log
    firing = run.events("alert_firing")
    publish = [e for e in firing if e.get("alert") == "TrainwatchCannotPublish"]
    assert publish and publish[0]["time"] - filled_at <= 30, (firing, filled_at)
    assert not stalls, "\n".join(json.dumps(f, default=str) for f in stalls[:5])
    assert not [e for e in firing if e.get("alert", "").startswith("TrainingStall")], firing
    assert not run.events("action_taken") and len(run.events("job_started")) == 1
    assert not run.events("restarted", "checkpoint_resumed")
    assert run.events("finished")
    # rank 1 waited on rank 0's evaluation and inherited its budget (300 s by default)
    assert budgets and max(b for b in budgets if b is not None) >= 300, budgets
    print(f"TrainwatchCannotPublish fired {publish[0]['time'] - filled_at:.1f} s after the "
          f"disk filled; {len(budgets)} looks at rank 1 waiting on rank 0's evaluation")


def test_a_hang_inside_the_evaluation_is_caught_within_its_phase_budget(tmp_path):
    run = RunDir(tmp_path / "exp")
    (tmp_path / "agent.yaml").write_text(
        "stall:\n  phase_budgets: {checkpoint: 600, eval: 15, init: 600}\n")
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
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        finally:
            kill_tree(proc)
    assert {0, 1} <= set(found), (found, (tmp_path / "run.log").read_text()[-3000:])
    events = [(e["event"], e.get("reason") or e.get("fault")) for e in run.events(
        "fault_injected", "job_started", "job_stopped", "job_exited", "alert_firing")]
    assert found[0]["phase"] == "eval" and found[0]["stall_kind"] == "stuck", (found, events)
    assert "waiting for rank 0 in eval" in found[1]["message"]
    began = injected[0]["time"]
    for rank in (0, 1):  # not before the evaluation's budget, and soon after it
        assert 14 <= found[rank]["detected_at"] - began <= 15 + 15, (found, began)
