"""A real ``trainwatch run`` SIGSTOPped: the agent it started (a process of its own, not
frozen with it) shows ``trainwatch_run_supervisor_up`` 0 within seconds, says so in its
log and pages TrainwatchSupervisorDown itself, with no Prometheus (its webhook and the
journal, within 30 s of the freeze); resumed, the supervisor is up again and the page
resolves."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agent_helpers import free_port, get_json, http_get, wait_for
from conftest import kill_tree
from trainwatch.contract.layout import AGENT_LOG
from trainwatch.rundir.run_dir import RunDir

pytestmark = pytest.mark.slow

UP = re.compile(rb"^trainwatch_run_supervisor_up\{[^}]*\} (\S+)$", re.M)


def supervisor_up(url: str) -> float | None:
    found = UP.search(http_get(url + "/metrics"))
    return float(found.group(1)) if found else None


class _Sink(BaseHTTPRequestHandler):
    """A webhook receiver: what ``trainwatch run --webhook`` is given."""

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.got.append((time.monotonic(), json.loads(body)))  # type: ignore[attr-defined]
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def pages(sink, status: str) -> list[float]:
    """When TrainwatchSupervisorDown came to the webhook with ``status``."""
    return [at for at, body in list(sink.got) if body["status"] == status
            and body["alerts"][0]["labels"]["alertname"] == "TrainwatchSupervisorDown"]


def test_a_frozen_trainwatch_run_is_seen_by_its_agent_within_seconds(tmp_path):
    port = free_port()
    run = RunDir(tmp_path / "r")
    log = tmp_path / "run.log"
    job = "import time\nwhile True:\n    time.sleep(1)\n"
    sink = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    sink.got = []  # type: ignore[attr-defined]
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    # The default supervisor_down_for (10 s); evaluated every second, not 5.
    (tmp_path / "thresholds.yaml").write_text("evaluation_interval: 1s\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainwatch", "run", "--run-dir", str(run.root), "--no-live",
         "--agent-port", str(port), "--thresholds", str(tmp_path / "thresholds.yaml"),
         "--webhook", f"http://127.0.0.1:{sink.server_address[1]}/hook",
         "--", sys.executable, "-c", job],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: supervisor_up(url) == 1, 90, what="the agent's supervisor_up 1: "
                 + (log.read_text()[-2000:] if log.exists() else ""))
        os.kill(proc.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        wait_for(lambda: supervisor_up(url) == 0, 30, interval=0.1,
                 what="supervisor_up 0 after SIGSTOP")
        seen_in = time.monotonic() - frozen_at
        assert seen_in < 30, seen_in
        seen = get_json(url + "/status")["supervisors"][str(run.root)]
        assert seen["state"] == "frozen" and seen["pid"] == proc.pid, seen
        agent_log = run.logs_dir / AGENT_LOG
        wait_for(lambda: "is frozen" in agent_log.read_text(), 10, what="the agent's log line")
        # The page, from the agent: the frozen supervisor's own engine sends nothing.
        paged = wait_for(lambda: pages(sink, "firing"), 30 - (time.monotonic() - frozen_at),
                         interval=0.2, what="TrainwatchSupervisorDown at the webhook")
        paged_in = paged[0] - frozen_at
        assert paged_in < 30, paged_in
        firing = [e for e in run.events("alert_firing")
                  if e["alert"] == "TrainwatchSupervisorDown"]
        assert firing and firing[0]["labels"]["run"] == "r", firing
        os.kill(proc.pid, signal.SIGCONT)
        wait_for(lambda: supervisor_up(url) == 1, 30, interval=0.1,
                 what="supervisor_up 1 after SIGCONT")
        wait_for(lambda: pages(sink, "resolved"), 30, interval=0.2, what="the page resolved")
        assert len(pages(sink, "firing")) == 1  # one page, from one path
        print(f"the agent saw the frozen supervisor in {seen_in:.1f} s, paged in "
              f"{paged_in:.1f} s")
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
        assert run.events("controller_stopped")
        assert not run.supervisor_lock_file.read_bytes()  # released: nothing left to page
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        kill_tree(proc)
        sink.shutdown()
        sink.server_close()
