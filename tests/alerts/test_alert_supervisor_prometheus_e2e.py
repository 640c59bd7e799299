"""Real Prometheus, at the shipped 5 s scrape and evaluation intervals, with the exported
rules: a supervisor SIGSTOPped while a real agent watches its run pages
(TrainwatchSupervisorDown firing) within 30 s of the freeze, and not before its ``for``."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from agent_helpers import start_agent, start_supervisor, stop_process, wait_for
from alerts_helpers import _free_port, _ready
from deploy_configs import prometheus_config
from trainwatch.rundir.run_dir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not shutil.which("prometheus"),
                                                   reason="prometheus missing")]


def _query(prom: str, expr: str) -> list[dict]:
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())["data"]["result"]


def _alert(prom: str, state: str) -> list[dict]:
    return _query(prom, f'ALERTS{{alertname="TrainwatchSupervisorDown",alertstate="{state}"}}')


def test_a_frozen_supervisor_pages_from_prometheus_within_30_seconds(tmp_path, processes):
    run = RunDir(tmp_path / "exp1").create()
    run.write_run_info({"job": "exp1"})
    supervisor = start_supervisor(run)
    agent = None
    try:
        agent, agent_url = start_agent(tmp_path, "--run-dir", str(run.root))
        rules = tmp_path / "rules.yaml"
        out = subprocess.run([sys.executable, "-m", "trainwatch", "alerts", "export", "-o",
                              str(rules)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        port = _free_port()
        prometheus_config(tmp_path / "prometheus.yml", rules,
                          {"trainwatch-agent": [agent_url.removeprefix("http://")]},
                          interval="5s")
        processes(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                   f"--storage.tsdb.path={tmp_path / 'prom-data'}",
                   f"--web.listen-address=127.0.0.1:{port}"], tmp_path / "prometheus.log")
        prom = f"http://127.0.0.1:{port}"
        _ready(prom + "/-/ready")
        wait_for(lambda: _query(prom, "trainwatch_run_supervisor_up == 1"), 60,
                 what="Prometheus scraping supervisor_up 1")

        os.kill(supervisor.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        firing = wait_for(lambda: _alert(prom, "firing"), 40, interval=0.5,
                          what="TrainwatchSupervisorDown firing")
        paged_in = time.monotonic() - frozen_at
        assert firing[0]["metric"]["run"] == "exp1"
        assert firing[0]["metric"]["severity"] == "critical"
        # Not before its for (10 s), within 30 s of the freeze.
        assert 10 <= paged_in < 30, f"paged {paged_in:.1f} s after the freeze"
        print(f"TrainwatchSupervisorDown fired {paged_in:.1f} s after SIGSTOP")
    finally:
        if supervisor.poll() is None:
            os.kill(supervisor.pid, signal.SIGCONT)
        stop_process(supervisor)
        if agent is not None:
            stop_process(agent)
