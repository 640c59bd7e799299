"""A real agent beside two real 2-rank gloo jobs, tried as an operator would: hostile files
dropped into a run directory, and the agent itself SIGSTOPped for a minute.

One module-scoped setup (two jobs, one agent) serves every test here: starting torchrun
jobs is the expensive part.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import psutil
import pytest

from agent_helpers import REPO, get_json, http_get, kill_pids, start_agent, stop_process, wait_for
from conftest import torchrun_env
from rundir_helpers import hostile

pytestmark = pytest.mark.slow


def _start_job(folder, name):
    run_dir = folder / name
    log = open(folder / f"{name}.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(REPO / "tests" / "jobs" / "agent_job.py"), str(run_dir)],
        env=torchrun_env(folder, TW_STEP_SLEEP="0.2"), stdout=log, stderr=subprocess.STDOUT,
        cwd=REPO)
    return proc, run_dir


def _pids(run_dir) -> dict[int, int]:
    pids = {}
    for rank in (0, 1):
        try:
            pids[rank] = json.loads((run_dir / "status" / f"rank-{rank:05d}.json").read_text())[
                "pid"]
        except (OSError, ValueError, KeyError):
            pass
    return pids


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hardening")
    jobs = {name: _start_job(folder, name) for name in ("healthy", "frozen")}
    agent, url = start_agent(folder, "--run-dir", str(jobs["healthy"][1]),
                             "--run-dir", str(jobs["frozen"][1]))
    try:
        for name in jobs:
            wait_for(lambda name=name: _ranks(url, name) and all(
                r["health"] == "ok" for r in _ranks(url, name).values())
                and len(_ranks(url, name)) == 2, 120, what=f"job {name} healthy in /status")
        yield {"agent": agent, "url": url, "jobs": jobs, "folder": folder}
    finally:
        os.kill(agent.pid, signal.SIGCONT)
        stop_process(agent)
        for proc, run_dir in jobs.values():
            pids = list(_pids(run_dir).values())
            kill_pids(pids)  # SIGCONT + SIGKILL: a frozen rank cannot stop cleanly
            stop_process(proc)


def _ranks(url, job) -> dict[int, dict]:
    status = get_json(url + "/status")
    for j in status["jobs"]:
        if j["job"] == job:
            return {r["rank"]: r for r in j["ranks"]}
    return {}


def _metric(text: str, name: str, **labels) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line[len(name):line.rindex("}") + 1]))
        if all(got.get(k) == str(v) for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def _scrape_p99(url: str, n: int = 60) -> float:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        http_get(url + "/metrics")
        times.append(time.perf_counter() - started)
        time.sleep(0.02)
    return statistics.quantiles(times, n=100)[98]


def test_hostile_status_files_cost_only_themselves(setup, tmp_path):
    url, agent = setup["url"], psutil.Process(setup["agent"].pid)
    run_dir = setup["jobs"]["healthy"][1]
    baseline = _scrape_p99(url)
    from trainwatch.rundir.run_dir import RunDir
    expected = hostile(RunDir(run_dir), tmp_path)
    reasons = sorted(set(expected.values()))
    ups, rss = [], []

    def all_counted():
        text = http_get(url + "/metrics").decode()
        ups.append(_metric(text, "trainwatch_collector_up", collector="ranks"))
        rss.append(agent.memory_info().rss)
        ranks = _ranks(url, "healthy")
        assert sorted(ranks) == [0, 1], ranks  # the real ranks stay visible throughout
        return all(_metric(text, "trainwatch_collector_status_files_skipped_total",
                           run="healthy", reason=r) for r in reasons)

    wait_for(all_counted, 60, what="every hostile file counted by its reason")
    with_files = _scrape_p99(url)
    for _ in range(5):  # a few more collector runs with every file in place
        all_counted()
        time.sleep(1)
    for name in expected:
        path = run_dir / "status" / name
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink()
    time.sleep(2)
    all_counted()
    print(f"/metrics p99 {baseline * 1e3:.1f} ms before, {with_files * 1e3:.1f} ms with the "
          f"hostile files; agent RSS max {max(rss) / 2 ** 20:.1f} MiB")
    assert ups and all(up == 1 for up in ups), ups
    assert max(rss) < 60 * 2 ** 20
    # Scrape latency is a speed goal (benchmarks/hostile_files.py measures it paired and
    # repeated); here only what cannot be noise: no byte of the 200 MB file was read.
    skipped = {s["path"].rsplit("/", 1)[-1]: s["code"] for s in [
        j for j in get_json(url + "/status")["jobs"] if j["job"] == "healthy"][0]["skipped"]}
    assert {k: v for k, v in skipped.items() if k in expected} == expected


def _stalls_total(url: str, job: str) -> float:
    text = http_get(url + "/metrics").decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("trainwatch_rank_stalls_total{") and f'run="{job}"' in line)


# 60 s is the figure operators reported; any pause longer than the heartbeat staleness
# (5 s) and the stall floor (5 s) used to produce the false verdicts, so the default run
# pauses 16 s (over three times each, past the 15 s case that was reported; the rank
# freezes 8 s before SIGCONT, past both too) to keep the suite short.
PAUSE = float(os.environ.get("TRAINWATCH_PAUSE_SECONDS", "16"))


def test_paused_agent_judges_nobody_on_old_observations(setup):
    """SIGSTOP the agent beside a healthy job and a job whose rank 1 freezes during the
    pause: after SIGCONT the healthy job has no stall and no stall counter moved; the
    frozen rank is reported."""
    url, agent = setup["url"], setup["agent"]
    frozen_pids = _pids(setup["jobs"]["frozen"][1])
    wait_for(lambda: all(r["health"] == "ok" for r in _ranks(url, "healthy").values()), 60,
             what="healthy job ok before the pause")
    before = _stalls_total(url, "healthy")
    os.kill(agent.pid, signal.SIGSTOP)
    try:
        time.sleep(PAUSE / 2)
        os.kill(frozen_pids[1], signal.SIGSTOP)  # a real freeze while nobody watches
        time.sleep(PAUSE / 2)
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    seen = []

    def frozen_reported():
        status = get_json(url + "/status")
        healthy = [j for j in status["jobs"] if j["job"] == "healthy"][0]
        seen.append([(r["rank"], r["health"], r["stall"]) for r in healthy["ranks"]])
        assert not [f for f in status["findings"] if f["job"] == "healthy"], status["findings"]
        assert all(r["health"] in ("ok", "unknown") for r in healthy["ranks"]), healthy
        return [f for f in status["findings"] if f["job"] == "frozen" and f.get("rank") == 1
                and f.get("stall_kind") == "frozen"]

    (finding,) = wait_for(frozen_reported, 60, interval=0.2,
                          what="frozen rank 1 reported after the pause")
    for _ in range(10):  # and the healthy job stays clean a while longer
        frozen_reported()
        time.sleep(0.5)
    assert _stalls_total(url, "healthy") == before
    assert finding["stalled_seconds"] >= PAUSE / 2 - 5
    print(f"paused {PAUSE:.0f} s; {len(seen)} /status reads after SIGCONT, none with a "
          "finding for the healthy job")
