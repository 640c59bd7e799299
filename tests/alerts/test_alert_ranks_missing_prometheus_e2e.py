"""Real Prometheus and two real agents on one shared run directory (2 nodes x 2 ranks, as
on cluster storage), with the exported rules: when node gpu-b is lost (its agent killed,
its ranks' statuses no longer written), "ranks up" reads 2 of 4, not 2 of 2, and
TrainingRanksMissing fires naming gpu-b — from the agent that remains, through a real
target going down (staleness), which promtool's scenarios can only imitate."""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import pytest

from agent_helpers import start_agent, stop_process, wait_for, write_status
from alerts_helpers import _free_port, _ready
from deploy_configs import prometheus_config
from trainwatch.rundir.run_dir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not shutil.which("prometheus"),
                                                   reason="prometheus missing")]
NODES = {"gpu-a": (0, 1), "gpu-b": (2, 3)}


def _query(prom: str, expr: str) -> list[dict]:
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())["data"]["result"]


def _value(prom: str, expr: str) -> float | None:
    found = _query(prom, expr)
    return float(found[0]["value"][1]) if found else None


def _ranks(run: RunDir, alive: dict[str, bool], stop: threading.Event) -> None:
    """Each node's ranks write their status every half second while their node lives
    (this test's pid stands for their processes: alive)."""
    while not stop.is_set():
        for node, ranks in NODES.items():
            if alive[node]:
                for rank in ranks:
                    write_status(run, rank, os.getpid(), node=node, world_size=4,
                                 local_rank=rank % 2)
        stop.wait(0.5)


def test_a_lost_node_reads_2_of_4_and_pages_naming_it(tmp_path, processes, monkeypatch):
    run = RunDir(tmp_path / "shared" / "exp").create()
    run.write_run_info({"job": "exp", "world_size": 4, "nnodes": 2})
    alive, stop = {"gpu-a": True, "gpu-b": True}, threading.Event()
    writer = threading.Thread(target=_ranks, args=(run, alive, stop), daemon=True)
    writer.start()
    (tmp_path / "agent.yaml").write_text("stall: {heartbeat_stale_seconds: 2}\n")
    (tmp_path / "thresholds.yaml").write_text("ranks_missing_for: 3s\n")
    agents = {}
    try:
        for node in NODES:
            monkeypatch.setenv("TRAINWATCH_NODE", node)
            agents[node] = start_agent(tmp_path, "--run-dir", str(run.root),
                                       config=tmp_path / "agent.yaml")
        rules = tmp_path / "rules.yaml"
        out = subprocess.run([sys.executable, "-m", "trainwatch", "alerts", "export",
                              "--thresholds", str(tmp_path / "thresholds.yaml"), "-o",
                              str(rules)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        port = _free_port()
        prometheus_config(tmp_path / "prometheus.yml", rules, {"trainwatch-agent": [
            url.removeprefix("http://") for _, url in agents.values()]}, interval="1s")
        processes(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                   f"--storage.tsdb.path={tmp_path / 'prom-data'}",
                   f"--web.listen-address=127.0.0.1:{port}"], tmp_path / "prometheus.log")
        prom = f"http://127.0.0.1:{port}"
        _ready(prom + "/-/ready")
        up = 'sum(trainwatch_rank_up{run="exp"})'
        expected = 'max(trainwatch_run_ranks_expected{run="exp"})'  # the panel's "of"
        wait_for(lambda: _value(prom, up) == 4 and _value(prom, expected) == 4, 60,
                 what="Prometheus scraping 4 of 4 ranks up")
        assert not _query(prom, 'ALERTS{alertname="TrainingRanksMissing"}')

        alive["gpu-b"] = False
        proc, _ = agents.pop("gpu-b")
        proc.kill()
        proc.wait(10)
        lost_at, lost_wall = time.monotonic(), time.time()
        firing = wait_for(lambda: _query(
            prom, 'ALERTS{alertname="TrainingRanksMissing",alertstate="firing"}'), 40,
            interval=0.5, what="TrainingRanksMissing firing")
        paged_in = time.monotonic() - lost_at
        assert [(a["metric"]["run"], a["metric"].get("node")) for a in firing] == [
            ("exp", "gpu-b")], firing
        assert _value(prom, up) == 2 and _value(prom, expected) == 4
        # Active (pending) only since the loss: the healthy job before it never was.
        active = _value(prom, 'ALERTS_FOR_STATE{alertname="TrainingRanksMissing"}')
        assert active is not None and active >= lost_wall - 1, (active, lost_wall)
        assert 3 <= paged_in < 20, f"paged {paged_in:.1f} s after the loss"
        print(f"TrainingRanksMissing named gpu-b {paged_in:.1f} s after the node was lost")
    finally:
        stop.set()
        writer.join(5)
        for proc, _ in agents.values():
            stop_process(proc)
