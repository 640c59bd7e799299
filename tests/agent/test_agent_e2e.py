"""End to end: a real agent process watching a real 2-rank gloo job, scraped by a real
Prometheus; SIGSTOP -> stall found and cleared; a slowed rank -> straggler found and
cleared; promtool accepts /metrics; SIGTERM stops the agent cleanly."""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest

from agent_helpers import (REPO, free_port, get_json, http_get, kill_pids, start_agent,
                           stop_process, wait_for)
from conftest import torchrun_env

pytestmark = pytest.mark.slow


@pytest.fixture
def job(tmp_path):
    """A 2-rank torchrun job (tests/jobs/agent_job.py); its ranks and torchrun killed by PID."""
    yield from _job(tmp_path, 2)


@pytest.fixture
def job4(tmp_path):
    """The same with 4 ranks and 50 ms steps, in timing windows of the telemetry's default."""
    from trainwatch.rank.telemetry import Telemetry
    window = inspect.signature(Telemetry).parameters["exchange_every"].default
    yield from _job(tmp_path, 4, TW_STEP_SLEEP="0.05", TW_SLOW_EXTRA="0.015",
                    TW_EXCHANGE_EVERY=str(window))


def _job(tmp_path, nproc, **env):
    run_dir = tmp_path / "run"
    log = open(tmp_path / "job.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={nproc}", str(REPO / "tests" / "jobs" / "agent_job.py"), str(run_dir)],
        env=torchrun_env(tmp_path, **env), stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    yield proc, run_dir
    pids = []
    for path in (run_dir / "status").glob("rank-*.json"):
        try:
            pids.append(json.loads(path.read_text())["pid"])
        except (OSError, ValueError, KeyError):
            pass
    # Nothing is asserted on the way out: the ranks first (SIGCONT, SIGKILL), so torchrun
    # has nothing left to wait for, then torchrun itself.
    kill_pids(pids)
    stop_process(proc)


@pytest.fixture
def prometheus(tmp_path):
    """Start a real Prometheus on 127.0.0.1 with its TSDB in tmp; returns (start, url)."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("Debian prometheus is not installed")
    port = free_port()
    procs = []

    def start(target: str) -> str:
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            f"  - job_name: trainwatch-agent\n    static_configs: [{{targets: ['{target}']}}]\n")
        log = open(tmp_path / "prometheus.log", "wb")
        procs.append(subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT))
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: http_get(url + "/-/ready"), 60, what="prometheus ready")
        return url

    yield start
    for proc in procs:
        stop_process(proc)


def _query(prom: str, expr: str) -> list:
    doc = get_json(f"{prom}/api/v1/query?query={urllib.parse.quote(expr)}")
    return doc["data"]["result"]


def _findings(url: str, kind: str) -> dict[int, dict]:
    return {f["rank"]: f for f in get_json(url + "/status")["findings"] if f["kind"] == kind}


def _read_int(path: Path) -> int | None:
    """A step a rank noted in a control file, once it is there and whole."""
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def _rank(url: str, rank: int) -> dict:
    for job in get_json(url + "/status")["jobs"]:
        for r in job["ranks"]:
            if r["rank"] == rank:
                return r
    return {}


def test_agent_end_to_end(tmp_path, job, prometheus):
    proc, run_dir = job
    config = tmp_path / "agent.yaml"
    config.write_text("collectors:\n  storage: {interval: 2}\n  network: {interval: 2}\n")
    agent, url = start_agent(tmp_path, "--run-dir", str(run_dir), config=config)
    try:
        # 1. both ranks seen, with timing windows scored
        wait_for(lambda: all(_rank(url, r).get("straggler") for r in (0, 1)), 90,
                 what="both ranks running with straggler scores")
        metrics = http_get(url + "/metrics")
        check = subprocess.run(["promtool", "check", "metrics"], input=metrics,
                               capture_output=True)
        assert check.returncode == 0, check.stdout + check.stderr
        assert re.search(rb'trainwatch_rank_up\{[^}]*run="run"', metrics)

        # 2. a real Prometheus scrapes it; the series are queryable
        prom = prometheus(url.removeprefix("http://"))
        series = wait_for(lambda: len(_query(prom, "trainwatch_rank_step")) == 2 and _query(
            prom, "trainwatch_rank_step"), 60, what="trainwatch_rank_step in Prometheus")
        assert {s["metric"]["rank"] for s in series} == {"0", "1"}
        assert _query(prom, 'trainwatch_collector_up{collector="ranks"} == 1')
        wait_for(lambda: _query(prom, 'trainwatch_network_peer_up{role="master"} == 1'), 30,
                 what="the job's master (MASTER_ADDR:MASTER_PORT) reachable")
        wait_for(lambda: _query(prom, 'trainwatch_storage_probe_success{role="run"} == 1'), 30,
                 what="storage probe of the run dir")

        # 3. clean run: no straggler over several windows, once the rule can judge both
        wait_for(lambda: all((_rank(url, r).get("straggler") or {}).get("judging")
                             for r in (0, 1)), 90, what="both ranks the straggler rule judges")
        clean_until = time.time() + 8
        while time.time() < clean_until:
            assert not _findings(url, "straggler"), _findings(url, "straggler")
            time.sleep(0.5)

        # 4. rank 1 at ~0.8x speed -> flagged within the goal (30 steps), rank 0 never
        (run_dir / "control" / "slow-1").touch()
        found = wait_for(lambda: _findings(url, "straggler").get(1), 60,
                         what="rank 1 flagged as straggler")
        slow_from = int((run_dir / "control" / "slow-1.from").read_text())
        steps = found["detected_step"] - slow_from
        print(f"straggler flagged at step {found['detected_step']}, {steps} steps after the "
              f"slowdown began (ratio {found['ratio']}, cause {found['cause']})")
        assert steps <= 30, f"flagged only after {steps} steps (goal 30)"
        assert 0 not in _findings(url, "straggler")
        assert found["cause"] in ("cpu_contention", "data_wait", "network_errors", "unknown")
        assert _query(prom, "trainwatch_straggler_active == 1") or wait_for(
            lambda: _query(prom, "trainwatch_straggler_active == 1"), 15, what="prom flag")
        assert "runs at 0." in found["message"], found["message"]  # never "1.02x the speed"
        # ... held while the rank stays slow (hysteresis): polled over the next 40 steps
        held, until = [], found["detected_step"] + 40
        while (_rank(url, 1).get("step") or 0) < until:
            held.append(1 in _findings(url, "straggler"))
            time.sleep(0.2)
        print(f"straggler flag up {sum(held)}/{len(held)} polls while slow")
        assert sum(held) >= 0.9 * len(held), held
        (run_dir / "control" / "slow-1").unlink()
        wait_for(lambda: not _findings(url, "straggler"), 60, what="straggler flag clears")
        until = wait_for(lambda: _read_int(run_dir / "control" / "slow-1.until"), 30,
                         what="rank 1's first normal step")
        cleared_after = _rank(url, 1)["straggler"]["cleared_step"] - until
        print(f"straggler flag cleared {cleared_after} steps after the rank recovered")
        assert cleared_after <= 30 + 10, cleared_after  # + the window the recovery began in

        # 5. SIGSTOP rank 1 -> frozen within 10 s of its last progress; rank 0 stuck
        pid = _rank(url, 1)["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            stall = wait_for(lambda: _findings(url, "stall").get(1), 30, what="rank 1 stalled")
            assert stall["stall_kind"] == "frozen"
            delay = stall["detected_at"] - stall["since"]
            print(f"stall detected {delay:.1f} s after the last progress")
            assert delay <= 10.0, f"stall detected {delay:.1f} s after last progress (goal 10)"
            assert _rank(url, 1)["process"]["status"] == "stopped"
            other = wait_for(lambda: _findings(url, "stall").get(0), 30, what="rank 0 stuck")
            assert other["stall_kind"] == "stuck"
            assert get_json(url + "/status")["health"] == "critical"
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: not _findings(url, "stall"), 30, what="stall clears after SIGCONT")
        cleared = get_json(url + "/status")["recently_cleared"]
        assert any(f["kind"] == "stall" and f["rank"] == 1 for f in cleared)
        assert _query(prom, 'trainwatch_rank_stalls_total{rank="1",kind="frozen"} >= 1') or \
            wait_for(lambda: _query(prom, 'trainwatch_rank_stalls_total{rank="1",kind="frozen"}'
                                          ' >= 1'), 15, what="stall counter in Prometheus")
    finally:
        code = stop_process(agent)
    assert code == 0, (tmp_path.glob("agent-*.log"))


def test_agent_exports_checkpoint_age_and_failures_of_the_real_trainer(tmp_path):
    """The reference trainer's checkpointer -> status file -> agent /metrics (what
    CheckpointTooOld and CheckpointFailed read); promtool accepts the output."""
    run_dir = tmp_path / "run"
    (tmp_path / "not-a-dir").write_text("the mirror cannot be created here")
    trainer = subprocess.Popen(
        [sys.executable, "-m", "trainwatch.trainer", "--run-dir", str(run_dir),
         "--set", "train.steps=40", "--set", "train.eval_interval=0",
         "--set", "data.corpus_bytes=200000", "--set", "telemetry.heartbeat_interval=0.2",
         "--set", "checkpoint.every_steps=5", "--set", "checkpoint.mode=sync",
         "--set", "checkpoint.fsync=false",
         "--set", f"checkpoint.mirror_dir={tmp_path / 'not-a-dir' / 'mirror'}"],
        env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path),
             "TRAINWATCH_FAULT": "hang:step=12"},  # parked after two saves, still running
        stdout=open(tmp_path / "trainer.log", "wb"), stderr=subprocess.STDOUT, cwd=REPO)
    config = tmp_path / "agent.yaml"
    config.write_text("collectors:\n  ranks: {interval: 0.5}\n")
    agent, url = start_agent(tmp_path, "--run-dir", str(run_dir), config=config)
    try:
        def exported():
            text = http_get(url + "/metrics").decode()
            lines = {line.split(" ")[0].split("{")[0]: line for line in text.splitlines()
                     if line.startswith("trainwatch_checkpoint_")}
            failures = lines.get("trainwatch_checkpoint_failures_total", "")
            return text if failures and float(failures.split()[-1]) >= 2 else None

        text = wait_for(exported, 120, what="two failed mirror copies in the agent's /metrics")
        age = next(line for line in text.splitlines()
                   if line.startswith("trainwatch_checkpoint_age_seconds{"))
        assert 'run="run"' in age and 0 <= float(age.split()[-1]) < 120
        check = subprocess.run(["promtool", "check", "metrics"], input=text.encode(),
                               capture_output=True)
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        stop_process(trainer, signal.SIGKILL)
        code = stop_process(agent)
    assert code == 0


def test_straggler_at_0_8x_in_a_4_rank_job_flagged_held_and_cleared(tmp_path, job4):
    """Rank 2 of 4 at ~0.8x speed (forward 65 ms instead of 50), default settings (the
    telemetry's 10-step windows, the agent's defaults): flagged within 30 steps, flagged in
    >= 98 % of polls while slow, cleared within 30 steps after; nobody else."""
    proc, run_dir = job4
    agent, url = start_agent(tmp_path, "--run-dir", str(run_dir))
    try:
        # The rule gives no verdict before it has a rank's noise (8 windows): a slowdown
        # before that would be timed from when the agent could first judge, not from itself.
        wait_for(lambda: all((_rank(url, r).get("straggler") or {}).get("judging")
                             for r in range(4)), 180, what="4 ranks the straggler rule judges")
        start = _rank(url, 0)["step"]
        wait_for(lambda: _rank(url, 0)["step"] >= start + 20, 60, what="20 clean steps")
        assert not _findings(url, "straggler")
        (run_dir / "control" / "slow-2").touch()
        found = wait_for(lambda: _findings(url, "straggler").get(2), 60, what="rank 2 flagged")
        seen_at = _rank(url, 2)["step"]
        slow_from = int((run_dir / "control" / "slow-2.from").read_text())
        print(f"4 ranks: straggler flagged {found['detected_step'] - slow_from} steps after the "
              f"slowdown, seen {seen_at - slow_from} steps after it (ratio {found['ratio']}, "
              f"{found['message']})")
        assert found["detected_step"] - slow_from <= 30 and "runs at 0." in found["message"]
        held, until = [], found["detected_step"] + 40
        while (_rank(url, 2).get("step") or 0) < until:
            flagged = _findings(url, "straggler")
            held.append(2 in flagged)
            assert set(flagged) <= {2}, flagged
            time.sleep(0.2)
        print(f"4 ranks: flag up {sum(held)}/{len(held)} polls while slow")
        assert sum(held) >= 0.98 * len(held), held
        (run_dir / "control" / "slow-2").unlink()
        wait_for(lambda: not _findings(url, "straggler"), 60, what="flag clears")
        # The last step of the window the verdict cleared on, as the agent recorded it: not
        # the step the rank had reached by the time the agent (every 1 s) and this test looked.
        cleared_at = _rank(url, 2)["straggler"]["cleared_step"]
        until = wait_for(lambda: _read_int(run_dir / "control" / "slow-2.until"), 30,
                         what="rank 2's first normal step")
        cleared_after = cleared_at - until
        print(f"4 ranks: flag cleared {cleared_after} steps after the rank recovered")
        assert cleared_after <= 30 + 10, cleared_after  # + the window the recovery began in
    finally:
        stop_process(agent)
