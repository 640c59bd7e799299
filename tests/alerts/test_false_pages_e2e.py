"""Pages that must not come: real jobs under `trainwatch run` (the agent, the embedded engine).

* a rank whose wall clock is 5 min behind the node's is neither down nor failed to start,
  and `trainwatch report` measures the run on one clock (a 20 s run is ~20 s, not 5 min);
* a run its supervisor stopped, whose ranks ignored SIGTERM and were SIGKILLed after the
  grace period (their statuses still say running), is not a rank down for an agent that
  keeps watching its folder; a new start makes it live again.
"""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent_helpers import http_get, start_agent, stop_process, wait_for
from conftest import kill_tree
from side_by_side import side_by_side
from trainwatch.alerts.engine import Engine
from trainwatch.alerts.evaluate import History
from trainwatch.alerts.rules import load_rules
from trainwatch.alerts.scrape import Scraper
from trainwatch.rundir.run_dir import RunDir

HERE = Path(__file__).parent
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("trainwatch.agent.daemon") is None,
    reason="needs the agent")]


def _configs(tmp_path, *extra):
    (tmp_path / "thresholds.yaml").write_text(
        "evaluation_interval: 1s\nstall_for: 2s\naction_min_interval_seconds: 30\n"
        + "".join(f"{line}\n" for line in extra))
    (tmp_path / "agent.yaml").write_text(
        "stall: {floor_seconds: 5, k: 10, first_step_seconds: 300}\n"
        "collectors:\n  ranks: {interval: 0.5}\n")


def _run(tmp_path, run_dir, args, env=None, timeout=420):
    cmd = [sys.executable, "-m", "trainwatch", "run", "--run-dir", str(run_dir), "--no-live",
           "--thresholds", str(tmp_path / "thresholds.yaml"),
           "--agent-config", str(tmp_path / "agent.yaml"), *args]
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    bin_dir = os.path.dirname(sys.executable)  # torchrun of this environment
    proc = subprocess.Popen(cmd, stdout=open(tmp_path / "run.log", "wb"),
                            stderr=subprocess.STDOUT,
                            env={**os.environ, "TMPDIR": str(scratch), "OMP_NUM_THREADS": "1",
                                 "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
                                 **(env or {})})
    try:
        return proc.wait(timeout=timeout)
    finally:
        kill_tree(proc)


def _fired(run: RunDir) -> list[str]:
    return [e["alert"] for e in run.events("alert_firing")]


def _a_rank_with_a_clock_5_min_behind_is_not_paged_and_the_report_keeps_one_clock(tmp_path):
    # The pages it must not get come within 10 s of a misjudgment (the defaults' minute
    # would outlast this short run): a rank wrongly seen down or failed to start fires.
    _configs(tmp_path, "rank_down_for: 10s", "startup_failed_for: 10s")
    run = RunDir(tmp_path / "exp1")
    steps, pace = 40, 0.5
    started = time.monotonic()
    code = _run(tmp_path, run.root, ["--", "torchrun", "--standalone", "--nproc-per-node", "2",
                                     str(HERE.parent / "jobs" / "skewed_clock_job.py"), str(steps), str(pace)],
                env={"TW_SKEW": "300"})
    took = time.monotonic() - started
    assert code == 0, (tmp_path / "run.log").read_text()[-3000:]
    behind = [e for e in run.events("rank_started") if e["rank"] == 1]
    ahead = [e for e in run.events("rank_started") if e["rank"] == 0]
    assert ahead[0]["time"] - behind[0]["time"] > 290  # the skew is real in the journal
    fired = _fired(run)
    # At first sight the rank looked 300 s stale (a stall) and its process younger than it
    # (gone: failed to start, then down).
    assert not {"TrainingStartupFailed", "TrainingRankDown", "TrainingStallSuspected",
                "TrainingStalled"} & set(fired), fired
    res = subprocess.run([sys.executable, "-m", "trainwatch", "report", str(run.root),
                          "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    wall = report["time"]["wall_seconds"]
    # The run's own span: at most the whole `trainwatch run` (agent start-up included).
    assert steps * pace <= wall <= took, (wall, took, report["categories"])
    # One clock: the skewed rank's start is no restart, its steps are counted once and
    # every paced step is productive (start-up's share depends on the machine's load).
    journal = [(round(e["time"], 2), e.get("source"), e["event"]) for e in run.events()]
    categories = report["categories"]
    assert report["steps"]["recomputed"] == 0 and categories["recomputed"] == 0 \
        and categories["restart_downtime"] == 0, (categories, journal)
    assert categories["productive"] >= 0.95 * steps * pace, (categories, journal)
    print(f"skewed rank: wall {wall:.1f} s of {took:.1f} s, goodput "
          f"{report['goodput_ratio']:.0%}, alerts {sorted(set(fired))}")


def _metric(text: str, name: str) -> list[float]:
    return [float(line.split()[-1]) for line in text.splitlines()
            if line.startswith(name + "{")]


def _a_run_its_supervisor_stopped_whose_ranks_were_sigkilled_pages_nobody(tmp_path):
    """`trainwatch run` is stopped (SIGTERM); its ranks ignore SIGTERM and are SIGKILLed
    after the grace period, so their statuses still say running. An agent that keeps
    watching the runs folder says the supervisor stopped the run, and the rules, replayed
    by the embedded engine on that agent's scrapes over 2 simulated minutes, page nothing;
    after a new start in the journal, the dead ranks page TrainingRankDown again."""
    _configs(tmp_path)
    runs = tmp_path / "runs"
    run = RunDir(runs / "exp").create()
    bin_dir = os.path.dirname(sys.executable)
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainwatch", "run", "--run-dir", str(run.root), "--no-live",
         "--thresholds", str(tmp_path / "thresholds.yaml"),
         "--agent-config", str(tmp_path / "agent.yaml"), "--",
         "torchrun", "--standalone", "--nproc-per-node=2", str(HERE.parent / "jobs" / "agent_job.py"),
         str(run.root)],
        stdout=open(tmp_path / "run.log", "wb"), stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TW_IGNORE_SIGTERM": "1",
             "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"})
    agent = None
    try:
        wait_for(lambda: len(run.statuses().records) == 2 and all(
            (s.get("step") or 0) >= 3 for s in run.statuses().records)
            or proc.poll() is not None, 180, what="both ranks past step 3")
        assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
        pids = [s["pid"] for s in run.statuses().records]
        proc.terminate()
        assert proc.wait(timeout=120) == 130, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        kill_tree(proc)
    (stopped,) = run.events("job_stopped")
    assert set(pids) <= set(stopped["killed"]), stopped  # SIGKILLed after the grace
    assert run.events()[-1]["event"] == "controller_stopped"
    assert {s["state"] for s in run.statuses().records} == {"running"}
    try:
        agent, url = start_agent(tmp_path, "--discover", str(runs))

        def scrape() -> str:
            return http_get(url + "/metrics").decode()

        def settled(stopped: float):
            def check():
                text = scrape()
                return (_metric(text, "trainwatch_run_supervisor_stopped") == [stopped]
                        and _metric(text, "trainwatch_rank_up") == [0.0, 0.0]
                        and min(_metric(text, "trainwatch_rank_steps_total")) >= 3)
            return check
        wait_for(settled(1.0), 60, what="the agent to say the supervisor stopped the run")
        engine = Engine(load_rules(), History())
        scraper = Scraper(engine.history, [url])
        t0 = time.time()

        def firing_over(seconds: float, start: float) -> set[str]:
            names: set[str] = set()
            for i in range(int(seconds / 15) + 1):
                scraper.scrape(url, start + 15 * i)
                engine.evaluate(start + 15 * i)
                names |= {a.name for alerts in engine.active.values() for a in alerts.values()
                          if a.state == "firing"}
            return names
        quiet = firing_over(120, t0)
        assert not quiet & {"TrainingRankDown", "TrainingStartupFailed", "TrainingStalled",
                            "TrainingStallSuspected", "CheckpointTooOld"}, quiet
        run.append_event("job_started", "engine", pid=1, reason="a new start", attempt=2)
        wait_for(settled(0.0), 60, what="the agent to see the run live again")
        assert "TrainingRankDown" in firing_over(120, t0 + 135)
    finally:
        if agent is not None:
            stop_process(agent)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Both runs side by side: paced steps and a grace period are mostly waiting."""
    with side_by_side(request, tmp_path_factory, {
        "test_a_rank_with_a_clock_5_min_behind_is_not_paged_and_the_report_keeps_one_clock":
            _a_rank_with_a_clock_5_min_behind_is_not_paged_and_the_report_keeps_one_clock,
        "test_a_run_its_supervisor_stopped_whose_ranks_were_sigkilled_pages_nobody":
            _a_run_its_supervisor_stopped_whose_ranks_were_sigkilled_pages_nobody,
    }) as running:
        yield running


def test_a_rank_with_a_clock_5_min_behind_is_not_paged_and_the_report_keeps_one_clock(runs, request):
    runs.result(request)


def test_a_run_its_supervisor_stopped_whose_ranks_were_sigkilled_pages_nobody(runs, request):
    runs.result(request)
