"""Helpers for the agent tests: free ports, polling, and processes stopped by PID."""

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

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.25,
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
