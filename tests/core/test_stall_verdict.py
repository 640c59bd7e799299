"""One stall rule: the agent, diagnose and report give the same budget and the same verdict.

A run directory is written with the real formats: rank 0 stepped 0.2 s per step, then went
6 s without progress (heartbeat fresh) before carrying on. With the default stall options
(budget max(5, 10 x 0.2) = 5 s) that silence is a stall; with the options the run recorded
(``trainwatch run`` journals its agent's: k = 40, floor 2 s, so 8 s) it is not. Each
component is asked through its own code path: the agent's detector, diagnose's analysis of
the gathered evidence, report's goodput account.
"""

from __future__ import annotations

import time

import pytest

from trainwatch.agent.config import build_config
from trainwatch.agent.stall import StallDetector
from trainwatch.contract.stall import default_options
from trainwatch.diagnose import casefile, journal, run_state
from trainwatch.diagnose.model import Evidence
from trainwatch.report import goodput
from trainwatch.report.timeline import read_timeline
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.atomic import append_jsonl

STEP = 0.2
SILENCE = 6.0
AGENT_YAML = {"stall": {"k": 40, "floor_seconds": 2}}


def write_run(root, *, record: dict | None) -> RunDir:
    """20 steps of 0.2 s, a 6 s silence (rank 0 still running), then 2 more steps."""
    run = RunDir(root).create()
    run.write_run_info({"job": "stall", "world_size": 1, "nproc_per_node": 1})
    now = time.time()
    start = now - 20 * STEP - SILENCE - 2 * STEP
    if record is not None:  # what `trainwatch run` records with the run
        append_jsonl(run.journal_file, {"v": 1, "time": start - 1, "event": "controller_started",
                                        "source": "engine", "host": "h", "stall": record})
    append_jsonl(run.journal_file, {"v": 1, "time": start, "event": "rank_started",
                                    "source": "rank0", "host": "h", "rank": 0, "pid": 1})
    t = start
    for step in range(22):
        t += STEP + (SILENCE if step == 20 else 0.0)
        append_jsonl(run.metrics_file(0), {"v": 1, "kind": "step", "step": step, "time": t,
                                           "rank": 0, "step_time_seconds": STEP,
                                           "tokens": 64, "loss": 1.0})
    return run


def live_status(now: float, step: int) -> dict:
    """Rank 0 as its status file shows it during the silence."""
    return {"rank": 0, "job": "stall", "node": "h", "pid": 1, "state": "running",
            "step": step, "phase": "forward", "heartbeat_at": now,
            "last_progress_at": now - SILENCE, "started_at": now - 100,
            "metrics": {"step": step, "step_time_seconds": STEP}}


def agent_verdict(options: dict) -> tuple[float, bool]:
    det = StallDetector(options)
    now = time.time()
    for step in range(20):  # the agent saw 20 steps of 0.2 s
        det.observe(("stall", 0), live_status(now, step))
    status = live_status(now, 19)  # as the ranks collector observes it: with ages
    view = {**status, "process": {"status": "sleeping"},
            "heartbeat_age": now - status["heartbeat_at"],
            "progress_age": now - status["last_progress_at"]}
    verdict = det.check(("stall", 0), view)
    return verdict.budget, verdict.stalled


def diagnose_verdict(run: RunDir, agents: list | None = None) -> tuple[float, bool]:
    run.write_status(0, live_status(time.time(), 19))
    ev = Evidence(run_dir=str(run.root), collected_at=time.time(), host="h")
    run_state.gather(run, ev)
    journal.gather(run, ev)
    ev.agents = agents or []
    a = casefile.Analysis(ev, None)
    return a.stall_after, a.stalled


def report_verdict(run: RunDir) -> tuple[float, bool]:
    account = goodput.account(read_timeline(run))
    return account.stall_budget_seconds, account.seconds["stalled"] > 0


@pytest.mark.parametrize("recorded,budget,stalled", [
    (None, 5.0, True),                                   # nothing recorded: the defaults
    (build_config(AGENT_YAML).stall, 8.0, False),        # the agent's non-default options
])
def test_agent_diagnose_and_report_agree(tmp_path, recorded, budget, stalled):
    options = recorded if recorded is not None else default_options()
    run = write_run(tmp_path / "run", record=recorded)
    verdicts = {"agent": agent_verdict(options), "diagnose": diagnose_verdict(run),
                "report": report_verdict(run)}
    assert {name: (pytest.approx(b), s) for name, (b, s) in verdicts.items()} == {
        name: (budget, stalled) for name in verdicts}


def test_diagnose_prefers_the_budget_the_agent_published(tmp_path):
    run = write_run(tmp_path / "run", record=None)
    published = {"jobs": [{"job": "stall", "ranks": [
        {"rank": 0, "state": "running", "stall": {"budget_seconds": 8.0, "stalled": False}}]}]}
    assert diagnose_verdict(run, [published]) == (8.0, False)
