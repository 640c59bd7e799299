"""The daemon: isolation of hung and failing collectors, scrapes served from stored values,
every exported family in the contract and accepted by promtool, SIGHUP reload, SIGTERM."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from agent_helpers import free_port, get_json, http_get, start_agent, stop_process, wait_for
from fake_nvml import FakeGpuBackend
from agent_helpers import FIXTURES, _gpu, write_status
from trainwatch.agent import registry
from trainwatch.agent.config import load_config
from trainwatch.agent.daemon import GC_YOUNG_OBJECTS, Agent
from trainwatch.agent.registry import Collector, Result, register
from trainwatch.contract.metrics import METRICS
from trainwatch.rundir.run_dir import RunDir


@pytest.fixture
def extra_collectors():
    """Register test-only collectors; unregistered afterwards."""
    release = threading.Event()
    added = []

    def add(name, cls, **kw):
        register(name, **kw)(cls)
        added.append(name)

    yield add, release
    release.set()
    for name in added:
        registry._REGISTRY.pop(name, None)


@pytest.fixture
def agent_factory(tmp_path):
    agents = []

    def make(**config) -> Agent:
        run = RunDir(tmp_path / "run").create()
        write_status(run, 0, os.getpid())
        cfg = load_config(None, run_dirs=[str(run.root)], listen=f"127.0.0.1:{free_port()}")
        for key, value in config.items():
            setattr(cfg, key, value)
        agent = Agent(cfg)
        agents.append(agent)
        return agent

    yield make
    for agent in agents:
        agent.stop()


def test_hung_collector_never_delays_metrics(agent_factory, extra_collectors):
    add, release = extra_collectors

    class Hangs(Collector):
        def collect(self):
            release.wait()  # blocks like a wedged driver call
            return Result()

    class Raises(Collector):
        def collect(self):
            raise RuntimeError("library crashed")

    add("test_hangs", Hangs, interval=0.3, timeout=0.5)
    add("test_raises", Raises, interval=0.3, timeout=0.5)
    agent = agent_factory()
    agent.start()
    url = f"http://{agent.address}"
    wait_for(lambda: agent.ctx.store.get("test_hangs").state == "timeout", 10,
             what="hung collector marked timeout")
    for _ in range(20):
        started = time.monotonic()
        body = http_get(url + "/metrics")
        assert time.monotonic() - started < 2.0  # generous: it is milliseconds in practice
    assert b'trainwatch_collector_state{collector="test_hangs",node=' in body
    assert b'trainwatch_collector_up{collector="test_hangs"' in body
    status = get_json(url + "/status")
    hung = status["collectors"]["test_hangs"]
    assert hung["state"] == "timeout" and hung["timeouts_total"] == 1  # never restarted
    assert "still hung" in hung["reason"] or "did not finish" in hung["reason"]
    failed = status["collectors"]["test_raises"]
    assert failed["state"] == "failed" and "library crashed" in failed["reason"]
    assert failed["errors_total"] >= 1
    runs = status["collectors"]["ranks"]["runs_total"]
    wait_for(lambda: get_json(url + "/status")["collectors"]["ranks"]["runs_total"] > runs, 10,
             what="the other collectors keep running")
    assert status["health"] == "degraded"
    release.set()  # the hung call returns: the collector recovers on its next run
    wait_for(lambda: agent.ctx.store.get("test_hangs").state == "ok", 10, what="recovery")


def test_every_family_is_in_the_contract_and_promtool_accepts_it(agent_factory):
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed")
    agent = agent_factory(sys_root=str(FIXTURES / "sys"))
    run = RunDir(agent.ctx.config.run_dirs[0])
    shutil.copy(FIXTURES / "journal" / "journal.jsonl", run.journal_file)
    fake = FakeGpuBackend([_gpu(0, pids=[os.getpid()]), _gpu(1, events={"hw_slowdown": True})])
    fake.pending_xids = [(0, 48)]
    agent.ctx.gpu_backend = lambda: fake
    agent.start()
    url = f"http://{agent.address}"
    for name in ("gpu", "network", "versions", "findings", "storage", "journal"):
        wait_for(lambda n=name: agent.ctx.store.get(n).state == "ok", 15, what=f"{name} ran")
    body = http_get(url + "/metrics")
    check = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr
    families = {line.split()[2] for line in body.decode().splitlines()
                if line.startswith("# TYPE")}
    # prometheus-client names a counter family with or without _total, by version.
    exported = {name for name in METRICS if name in families
                or name.removesuffix("_total") in families}
    for prefix in ("trainwatch_gpu_", "trainwatch_network_ib_", "trainwatch_storage_",
                   "trainwatch_rank_", "trainwatch_process_", "trainwatch_collector_",
                   "trainwatch_alert_", "trainwatch_action_", "trainwatch_checkpoint_"):
        assert any(n.startswith(prefix) for n in exported), prefix
    assert agent.exporter.rejected == set()
    assert b'trainwatch_gpu_process_memory_bytes{gpu="0"' in body
    status = get_json(url + "/status")
    assert status["jobs"][0]["ranks"][0]["gpus"][0]["uuid"] == "GPU-0000"
    assert status["versions"]["driver"] == "550.54.15"


def test_sighup_reloads_config_and_sigterm_exits_cleanly(tmp_path):
    run = RunDir(tmp_path / "run").create()
    write_status(run, 0, os.getpid())
    config = tmp_path / "agent.yaml"
    config.write_text("collectors:\n  network: {enabled: true}\n")
    proc, url = start_agent(tmp_path, "--run-dir", str(run.root), config=config)
    try:
        assert get_json(url + "/status")["collectors"]["network"]["enabled"] is True
        loaded = get_json(url + "/status")["agent"]["config_loaded_at"]
        config.write_text("collectors:\n  network: {enabled: false}\nstall: {floor_seconds: 2}\n")
        proc.send_signal(signal.SIGHUP)
        # The file is validated in a child process (a Python start: seconds on a loaded node)
        wait_for(lambda: get_json(url + "/status")["collectors"]["network"]["state"] ==
                 "disabled", 60, what="network disabled after SIGHUP")
        assert get_json(url + "/status")["agent"]["config_loaded_at"] > loaded
        config.write_text("collectors:\n  network: {enabled: maybe}\n")  # bad: keep running
        proc.send_signal(signal.SIGHUP)
        log_file = next(Path(tmp_path).glob("agent-*.log"))
        wait_for(lambda: "config reload failed" in log_file.read_text(), 60,
                 what="the bad file's reload refused")
        assert proc.poll() is None
        assert get_json(url + "/status")["collectors"]["network"]["state"] == "disabled"
    finally:
        code = stop_process(proc, signal.SIGTERM)
    assert code == 0
    log = log_file.read_text()
    assert "config reload failed" in log and "collectors.network.enabled" in log
    assert "agent stopped" in log


def test_the_start_and_stop_lines_are_normal_output_not_warnings(tmp_path):
    """Without -v (as systemd starts it) the start line was a WARNING on stderr; it is the
    command's output, which the journal shows, and stderr keeps the real warnings.
    An agent on the defaults (no config file) never loads pydantic (~10 MiB of its RSS):
    not at start, not in its collectors' first runs."""
    import sys
    run = RunDir(tmp_path / "run").create()
    port = free_port()
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen([sys.executable, "-m", "trainwatch", "agent", "--run-dir",
                                 str(run.root), "--listen", f"127.0.0.1:{port}"], stdout=o,
                                stderr=e)
    try:
        line = f"trainwatch agent serving on http://127.0.0.1:{port} (/metrics /status /healthz)"
        wait_for(lambda: line in out.read_text(), 60, what="the start line on stdout")
        url = f"http://127.0.0.1:{port}/status"
        wait_for(lambda: get_json(url)["collectors"]["journal"]["last_run_at"], 30,
                 what="the collectors' first runs (journal's is the last, 2 s after start)")
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "pydantic" not in maps, "the agent loaded pydantic without a config file"
    finally:
        assert stop_process(proc, signal.SIGTERM) == 0
    assert out.read_text().splitlines()[-1] == "trainwatch agent stopped"
    assert "WARNING" not in err.read_text(), err.read_text()


def test_discover_finds_run_dirs_as_they_appear(tmp_path):
    from trainwatch.agent.context import AgentContext
    folder = tmp_path / "runs"
    folder.mkdir()
    ctx = AgentContext(load_config(None, discover=[str(folder)]))
    assert ctx.run_dirs() == []
    RunDir(folder / "exp1").create()
    (folder / "not-a-run").mkdir()
    assert [r.root.name for r in ctx.run_dirs()] == ["exp1"]


def test_stop_does_not_wait_for_a_hung_collector(agent_factory, extra_collectors):
    add, release = extra_collectors

    class Hangs(Collector):
        def collect(self):
            release.wait()
            return Result()

    add("test_hangs_long", Hangs, interval=0.2, timeout=60)
    agent = agent_factory()
    agent.start()
    wait_for(lambda: agent.ctx.store.get("test_hangs_long").runs >= 1, 10, what="hung run began")
    started = time.monotonic()
    agent.stop()
    agent.runner._scheduler._executors["default"]._pool.shutdown(wait=True)  # as exit does
    assert time.monotonic() - started < 5


def test_the_agent_collects_young_garbage_in_large_batches(agent_factory):
    """Python's default young-generation threshold (700) walked the agent's transient rows
    twice a second at 64 ranks; what it made after start dies by reference counting."""
    import gc

    before = gc.get_threshold()
    try:
        agent_factory().start()
        assert gc.get_threshold() == (GC_YOUNG_OBJECTS, *before[1:]) and GC_YOUNG_OBJECTS >= 10_000
    finally:
        gc.set_threshold(*before)


def test_a_follower_runs_right_after_its_leader_even_while_the_leader_hangs(
        agent_factory, extra_collectors):
    """Findings judge what ranks just read: a collector registered ``after`` another of the
    same interval runs in its job, right after each of its runs (one scheduler wake-up and
    one render for both); a hung leader does not stop it; another interval keeps its own."""
    add, release = extra_collectors
    seen: list[str] = []

    class Leader(Collector):
        def collect(self):
            seen.append("leader")
            if seen.count("leader") >= 3:
                release.wait()  # the third run hangs
            return Result()

    class Follower(Collector):
        def collect(self):
            seen.append("follower")
            return Result()

    class OwnPace(Collector):
        def collect(self):
            return Result()

    add("test_leader", Leader, interval=0.3, timeout=0.5)
    add("test_follower", Follower, interval=0.3, timeout=0.5, after="test_leader")
    add("test_own_pace", OwnPace, interval=0.6, timeout=0.5, after="test_leader")
    agent = agent_factory()
    agent.start()
    scheduler = agent.runner._scheduler
    assert scheduler.get_job("test_follower") is None
    assert scheduler.get_job("test_own_pace") is not None
    assert scheduler.get_job("findings") is None and scheduler.get_job("replicas") is None
    wait_for(lambda: seen.count("follower") >= 6, 15, what="the follower runs on")
    assert seen[:6] == ["leader", "follower"] * 3
    assert seen.count("leader") == 3  # hung, not started again
    assert agent.ctx.store.get("test_leader").state == "timeout"
    assert agent.ctx.store.get("test_follower").state == "ok"


def test_the_agent_command_keeps_malloc_to_two_arenas_and_maps_large_blocks():
    """Each of the agent's threads had a malloc arena of its own and large freed blocks
    (a /metrics body) stayed in the heaps: the command sets what the environment does
    not (glibc; run in a child, so this process keeps its own)."""
    import sys
    probe = ("import json; from trainwatch.agent.malloc import tune_malloc; "
             "print(json.dumps(tune_malloc()))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=env, check=True)
    assert json.loads(out.stdout) == {"MALLOC_ARENA_MAX": 2, "MALLOC_MMAP_THRESHOLD_": 131072}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env={**env, "MALLOC_ARENA_MAX": "8"}, check=True)
    assert json.loads(out.stdout) == {"MALLOC_MMAP_THRESHOLD_": 131072}  # the unit's wins
