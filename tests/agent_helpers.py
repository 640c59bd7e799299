"""Helpers for the agent tests: free ports, polling, processes stopped by PID, and collectors
run against fixture trees."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

from trainwatch.agent.config import build_config
from trainwatch.agent.context import AgentContext
from trainwatch.agent.registry import Result, all_collectors
from trainwatch.agent.state import CollectorRecord
from trainwatch.host.nvml import GpuSnapshot
from trainwatch.rundir.run_dir import RunDir

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.25,
             what: str = "condition") -> Any:
    deadline = time.time() + timeout
    last_exc = None
    while time.time() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # retried until the deadline
            last_exc = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}"
                         + (f" (last error: {last_exc!r})" if last_exc else ""))


def http_get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read()


def get_json(url: str) -> Any:
    return json.loads(http_get(url))


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def start_agent(tmp_path: Path, *args: str, config: Path | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "trainwatch", "-v", "agent", "--listen", f"127.0.0.1:{port}", *args]
    if config is not None:
        cmd += ["--config", str(config)]
    log = open(tmp_path / f"agent-{port}.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http_get(url + "/healthz") == b"ok\n", 30, what="agent /healthz")
    except AssertionError:
        stop_process(proc)
        raise AssertionError((tmp_path / f"agent-{port}.log").read_text()[-3000:]) from None
    return proc, url


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


FIXTURES = Path(__file__).parent / "fixtures"


def make_ctx(run_dirs=(), **config) -> AgentContext:
    cfg = build_config({"run_dirs": [str(p) for p in run_dirs], **config})
    cfg.node = "node-a"
    return AgentContext(cfg)


def collector(ctx: AgentContext, name: str):
    return all_collectors()[name].factory(ctx, ctx.config.collector(name))


def publish(ctx: AgentContext, name: str, result: Result) -> None:
    ctx.store.set(CollectorRecord(name, True, 1, 1, state=result.state, data=result.data,
                                  samples=tuple(result.every_sample())))


def samples(result: Result, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for s in result.every_sample() if s.name == name}


def value(result: Result, name: str, **labels) -> float:
    for s in result.every_sample():
        if s.name == name and all(s.labels.get(k) == str(v) for k, v in labels.items()):
            return s.value
    raise KeyError(f"{name} {labels}")


def write_status(run: RunDir, rank: int, pid: int, **extra) -> None:
    now = time.time()
    run.write_status(rank, {"job": "exp", "rank": rank, "local_rank": rank, "world_size": 2,
                            "node": socket.gethostname(), "pid": pid, "backend": "gloo",
                            "device": "cpu", "started_at": now, "heartbeat_at": now,
                            "step": 3, "phase": "forward", "phase_since": now,
                            "last_progress_at": now, "state": "running",
                            "metrics": {"step": 3, "loss": 1.5, "step_time_seconds": 0.1},
                            "counters": {"steps_total": 4}, **extra})


def _gpu(index, pids=(), **kw):
    events = {"gpu_idle": False, "sw_power_cap": False, "hw_slowdown": False,
              "sw_thermal": False, "hw_thermal": False, "hw_power_brake": False}
    events.update(kw.pop("events", {}))
    return GpuSnapshot(index=index, uuid=f"GPU-{index:04d}", name="Fake H100",
                       utilization=0.9, memory_used=40 << 30, memory_total=80 << 30,
                       temperature=71.0, power_watts=650.0, power_limit_watts=700.0,
                       sm_clock_hz=1.98e9, sm_clock_max_hz=1.98e9, clock_events=events,
                       ecc={"corrected": 3, "uncorrected": 0},
                       retired_pages={"single_bit": 0, "double_bit": 0}, retired_pending=False,
                       remapped_rows={"correctable": 1, "uncorrectable": 0},
                       remap_pending=False, remap_failed=False,
                       nvlink_errors={0: {"replay": 2, "recovery": 0, "crc_flit": 1,
                                          "crc_data": 0}},
                       pcie_replay=0, processes=[(p, 1 << 30) for p in pids], **kw)


# A stand-in supervisor: the lock and the heartbeat of trainwatch run, then it waits; a
# SIGTERM releases the lock as a clean stop does.
SUPERVISOR = """
import signal, sys, threading
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.runlock import acquire
from trainwatch.rundir.supervisor_beat import SupervisorBeat
run = RunDir(sys.argv[1])
node = sys.argv[4] if len(sys.argv) > 4 else None  # one node's of a multi-node job
lock = acquire(run, sys.argv[2], node)
beat = SupervisorBeat(run, lock.holder, interval=0.2, path=(
    run.node_supervisor_beat_file(node) if node else None)).start() \
    if sys.argv[3] == "beat" else None
done = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: done.set())
print("ready", flush=True)
done.wait()
if beat is not None:
    beat.stop()
lock.release()
"""


def start_supervisor(run: RunDir, role: str = "trainwatch run", beat: bool = True,
                     node: str | None = None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(run.root), role,
                             "beat" if beat else "none", *([node] if node else [])],
                            stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    return proc
