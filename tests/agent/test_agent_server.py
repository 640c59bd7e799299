"""The agent's HTTP server: exposition formats, gzip, and bounded under hostile clients.

One real agent process (module scope) watching a run directory with two rank status
files. Formats: the classic text format by default (promtool lints it), OpenMetrics when
the scrape asks (prometheus-client's strict OpenMetrics parser reads it), gzip when
asked. Bounded: in a pids cgroup with the systemd unit's TasksMax, 500 idle connections
held open do not stop /metrics and /healthz from answering (a thread per connection
did); clients that go away mid-response cost one log line, no traceback.
"""

from __future__ import annotations

import gzip
import os
import shutil
import socket
import struct
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from agent_helpers import start_agent, stop_process, wait_for
from deploy_configs import unit_service_settings
from trainwatch.rundir.run_dir import RunDir

PIDS_ROOT = Path("/sys/fs/cgroup/pids")  # cgroup v1; v2 is handled below


def _get(url: str, headers: dict[str, str] | None = None, method: str = "GET"):
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.status, resp.headers, resp.read()


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    run = RunDir(tmp / "exp1").create()
    for rank in (0, 1):
        run.write_status(rank, {"job": "exp1", "rank": rank, "local_rank": rank,
                                "world_size": 2, "pid": os.getpid(), "state": "running",
                                "step": 3, "heartbeat_at": time.time()})
    proc, url = start_agent(tmp, "--run-dir", str(run.root))
    wait_for(lambda: b"trainwatch_rank_up{" in _get(url + "/metrics")[2], 30,
             what="rank series in /metrics")
    yield proc, url, tmp
    stop_process(proc)


def test_text_by_default_openmetrics_when_asked_gzip_when_asked(agent):
    _, url, _ = agent
    code, headers, text = _get(url + "/metrics")
    assert code == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    if shutil.which("promtool"):
        lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True)
        assert lint.returncode == 0, lint.stdout + lint.stderr

    code, headers, om = _get(url + "/metrics", {
        "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"})
    assert headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    assert om.endswith(b"# EOF\n")
    families = {f.name: f for f in text_string_to_metric_families(om.decode())}  # strict
    assert families["trainwatch_collector_runs"].type == "counter"
    assert {s.labels["rank"] for s in families["trainwatch_rank_up"].samples} == {"0", "1"}

    code, headers, packed = _get(url + "/metrics", {"Accept-Encoding": "gzip"})
    assert headers["Content-Encoding"] == "gzip" and "Accept-Encoding" in headers["Vary"]
    assert gzip.decompress(packed).startswith(b"# HELP ")
    assert len(packed) < len(text) / 3
    _, headers, _ = _get(url + "/metrics", {"Accept-Encoding": "gzip;q=0"})
    assert "Content-Encoding" not in headers

    code, headers, body = _get(url + "/metrics", method="HEAD")
    assert code == 200 and body == b"" and int(headers["Content-Length"]) > 1000
    with pytest.raises(urllib.error.HTTPError) as err:
        _get(url + "/metrics", method="POST")
    assert err.value.code == 405


def _pids_cgroup(limit: int):
    """A fresh pids cgroup with pids.max = limit (v1 or v2), or None if not writable."""
    for root in (PIDS_ROOT, Path("/sys/fs/cgroup")):
        if not (root / "cgroup.procs").exists():
            continue
        if root == Path("/sys/fs/cgroup") and "pids" not in (
                (root / "cgroup.subtree_control").read_text() if
                (root / "cgroup.subtree_control").exists() else ""):
            continue
        group = root / f"trainwatch-test-{os.getpid()}"
        try:
            group.mkdir()
            (group / "pids.max").write_text(str(limit))
            return group
        except OSError:
            return None
    return None


def test_500_idle_connections_under_the_units_tasks_max_do_not_starve_scrapes(agent):
    proc, url, tmp = agent
    limit = int(unit_service_settings()["TasksMax"])
    group = _pids_cgroup(limit)
    if group is None:
        pytest.skip("no writable pids cgroup here")
    host, port = url.removeprefix("http://").split(":")
    idle: list[socket.socket] = []
    try:
        (group / "cgroup.procs").write_text(str(proc.pid))
        for _ in range(500):
            s = socket.create_connection((host, int(port)), timeout=10)
            idle.append(s)
        # Half of them half-sent a request, as a slow client would.
        for s in idle[::2]:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        time.sleep(1)
        tasks = int((group / "pids.current").read_text())
        assert tasks <= limit
        for _ in range(20):
            assert _get(url + "/metrics")[0] == 200
            assert _get(url + "/healthz")[2] == b"ok\n"
        assert int((group / "pids.current").read_text()) <= limit
    finally:
        for s in idle:
            s.close()
        _leave_cgroup(group, proc.pid)
    log = next(tmp.glob("agent-*.log")).read_text()
    assert "Traceback" not in log and "can't start new thread" not in log


def _leave_cgroup(group: Path, pid: int) -> None:
    try:
        (group.parent / "cgroup.procs").write_text(str(pid))
    except OSError:
        pass
    wait_for(lambda: not (group / "cgroup.procs").read_text().strip(), 10,
             what="cgroup empty")
    group.rmdir()


def test_clients_that_go_away_cost_one_log_line_and_no_traceback(agent):
    _, url, tmp = agent
    host, port = url.removeprefix("http://").split(":")
    for _ in range(20):
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n")
        # Reset, not a polite close: the agent's write meets a dead peer.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 400 ")
    assert _get(url + "/healthz")[2] == b"ok\n"
    log = next(tmp.glob("agent-*.log")).read_text()
    assert "Traceback" not in log, log[-3000:]


def test_a_body_served_again_is_not_compressed_again(monkeypatch):
    """Prometheus asks for gzip on every scrape; two servers scraping one agent (an HA
    pair), or a scrape within the body's life, get the compressed bytes already made."""
    from trainwatch.agent import server as module
    from trainwatch.serving.httpserver import Request

    made = []
    compress = gzip.compress
    monkeypatch.setattr(module.gzip, "compress", lambda data, level: made.append(data)
                        or compress(data, level))
    bodies = [b"# HELP a b\n# TYPE a gauge\na 1\n" * 50]
    served = module.AgentHTTPServer(("127.0.0.1", 0), lambda accept: (bodies[-1], "text/plain"),
                                    dict, lambda: True)
    try:
        scrape = Request("GET", "/metrics", {"accept-encoding": "gzip"}, b"")
        first, again = served._route(scrape), served._route(scrape)
        assert first[2] is again[2] and gzip.decompress(first[2]) == bodies[-1]
        bodies.append(b"# HELP a b\n# TYPE a gauge\na 2\n" * 50)  # a new body: compressed
        assert gzip.decompress(served._route(scrape)[2]) == bodies[-1]
        assert len(made) == 2
    finally:
        served.server_close()
