"""Real Prometheus -> real Alertmanager -> trainwatch's webhook receiver -> restart.

Prometheus (rules exported by `trainwatch alerts export`) scrapes an exporter with
a stalled rank; TrainingStallSuspected fires; Alertmanager routes it to the receiver, which
captures evidence and restarts the real job process.  Alertmanager's own repeated
notifications of the same alert are duplicate deliveries that must not act again.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from trainwatch.alerts.actions import ActionRunner, Policy
from trainwatch.alerts.controller import JobController
from trainwatch.alerts.receiver import Receiver
from trainwatch.alerts.rules import load_rules
from trainwatch.contract.metrics import METRICS

from deploy_configs import alertmanager_config, prometheus_config
from agent_helpers import wait_for
from test_alert_actions import JOB_SCRIPT, TOKEN, _starts

ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not (shutil.which("prometheus") and ALERTMANAGER), reason="prometheus/alertmanager missing")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(url: str, timeout: float = 60) -> None:
    def ok():
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False
    wait_for(ok, timeout)


@pytest.fixture
def processes():
    procs = []

    def start(cmd, log):
        p = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_prometheus_alertmanager_webhook_restarts_the_job_once(tmp_path, processes):
    # The job, its controller and the receiver.
    script = tmp_path / "job.py"
    script.write_text(JOB_SCRIPT)
    run_dir = tmp_path / "exp1"
    controller = JobController(run_dir, [sys.executable, str(script), str(run_dir)],
                               stop_grace_seconds=3)
    thresholds = tmp_path / "thresholds.yaml"
    thresholds.write_text("stall_for: 1h\n")  # the early action acts; the page never fires
    ruleset = load_rules(thresholds_file=thresholds)
    runner = ActionRunner(run_dir, controller, Policy(min_interval_seconds=3600))
    receiver = Receiver(ruleset, runner, TOKEN).start()
    registry = CollectorRegistry()
    spec = METRICS["trainwatch_stall_incident_seconds"]
    stall = Gauge(spec.name, "stall", list(spec.labels), registry=registry)
    waiting = METRICS["trainwatch_stall_incident_ranks"]
    Gauge(waiting.name, "ranks", list(waiting.labels), registry=registry).labels(
        "exp1", "n1", "waiting").set(1)
    exporter, exporter_thread = start_http_server(0, "127.0.0.1", registry)
    exporter_port = exporter.server_address[1]
    try:
        controller.start()
        wait_for(lambda: controller.rank_pids(), 30)
        stall.labels("exp1", "n1", "0", "frozen").set(0)

        # The shipped Alertmanager config, re-notifying every few seconds.
        am_port, prom_port = _free_port(), _free_port()
        (tmp_path / "token").write_text(TOKEN)
        alertmanager_config(tmp_path / "alertmanager.yml", receiver.url, tmp_path / "token")
        processes([ALERTMANAGER, f"--config.file={tmp_path / 'alertmanager.yml'}",
                   f"--storage.path={tmp_path / 'am-data'}", "--cluster.listen-address=",
                   f"--web.listen-address=127.0.0.1:{am_port}"], tmp_path / "alertmanager.log")
        rules = tmp_path / "rules.yaml"
        out = subprocess.run([sys.executable, "-m", "trainwatch", "alerts", "export",
                              "--thresholds", str(thresholds), "-o", str(rules)],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        prometheus_config(tmp_path / "prometheus.yml", rules,
                          {"trainwatch-agent": [f"127.0.0.1:{exporter_port}"]},
                          alertmanager=f"127.0.0.1:{am_port}")
        processes(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                   f"--storage.tsdb.path={tmp_path / 'prom-data'}",
                   f"--web.listen-address=127.0.0.1:{prom_port}"], tmp_path / "prometheus.log")
        _ready(f"http://127.0.0.1:{am_port}/-/ready")
        _ready(f"http://127.0.0.1:{prom_port}/-/ready")

        # The rank freezes; the agent would report it as stalled.
        first_pid = controller.proc.pid
        os.kill(controller.rank_pids()[0], signal.SIGSTOP)
        stall.labels("exp1", "n1", "0", "frozen").set(120)

        taken = wait_for(lambda: runner.run.events("action_taken"), 90)
        assert taken[0]["alert"] == "TrainingStallSuspected" and taken[0]["delivery"] == "webhook"
        # one alert per run incident: the run and the culprit, not the scrape job's labels
        assert taken[0]["labels"]["culprit_rank"] == "0" and taken[0]["labels"]["run"] == "exp1"
        wait_for(lambda: len(_starts(controller.run)) == 2, 30)
        assert controller.proc.pid != first_pid and controller.alive()

        # Alertmanager notifies again (repeat_interval): the same alert must not act twice.
        dup = wait_for(lambda: [e for e in runner.run.events("action_skipped")
                                if "duplicate delivery" in e["reason"]], 60)
        assert dup[0]["fingerprint"] == taken[0]["fingerprint"]
        assert len(runner.run.events("action_taken")) == 1
        assert len(_starts(controller.run)) == 2
        assert TOKEN not in (tmp_path / "alertmanager.log").read_text()
    finally:
        receiver.stop()
        exporter.shutdown()
        exporter.server_close()
        if controller.alive():
            controller.stop("test teardown")
    print(json.dumps(taken[0], default=str)[:300])
