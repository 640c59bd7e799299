"""The agents' scrape job is a selector setting (``agent_job``), not a literal in many files.

A user whose Prometheus names the job otherwise sets it once, in a thresholds file: the
exported rules, the dashboards and the embedded engine's own scrape all follow; the shipped
scrape configs name the default.
"""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainwatch.alerts.engine import Engine
from trainwatch.alerts.evaluate import History
from trainwatch.alerts.export import prometheus_yaml
from trainwatch.alerts.loop import EngineLoop
from trainwatch.alerts.rules import AGENT_JOB, load_rules, load_thresholds
from trainwatch.alerts.scrape import Scraper
from trainwatch.dashboards.generate import build_all
from trainwatch.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
DEFAULT_JOB = "trainwatch-agent"


@pytest.fixture
def renamed(tmp_path):
    override = tmp_path / "selectors.yaml"
    override.write_text("agent_job: gpu-node-exporter\nagent_down_for: 30s\n")
    return override


def test_the_default_is_the_job_the_shipped_scrape_configs_name():
    assert load_thresholds()[AGENT_JOB] == DEFAULT_JOB
    prometheus = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert DEFAULT_JOB in [job["job_name"] for job in prometheus["scrape_configs"]]
    # prometheus-operator names the job after the Service's jobLabel label
    monitor = yaml.safe_load(
        (REPO / "deploy" / "kubernetes" / "base" / "servicemonitor.yaml").read_text())
    services = [doc for doc in yaml.safe_load_all(
        (REPO / "deploy" / "kubernetes" / "base" / "agent.yaml").read_text())
        if doc and doc["kind"] == "Service"]
    assert [s["metadata"]["labels"][monitor["spec"]["jobLabel"]] for s in services] == [
        DEFAULT_JOB]


def test_the_exported_rules_select_the_job_a_users_file_names(renamed):
    text = prometheus_yaml(load_rules(thresholds_file=renamed))
    assert 'up{job="gpu-node-exporter"} == 0' in text
    assert DEFAULT_JOB not in text
    cli = subprocess.run([sys.executable, "-m", "trainwatch", "alerts", "export",
                          "--thresholds", str(renamed)], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == text


def test_the_dashboards_select_the_job_a_users_file_names(renamed):
    default = next(d for d in build_all() if d["uid"] == "trainwatch-self")
    board = next(d for d in build_all(thresholds_file=renamed) if d["uid"] == "trainwatch-self")
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert 'sum(up{job="gpu-node-exporter"})' in exprs
    assert DEFAULT_JOB not in str(board)
    assert str(board) == str(default).replace(DEFAULT_JOB, "gpu-node-exporter")


@pytest.mark.parametrize("value", ['"a\\"b"', '""', "'a\\b'"])
def test_a_job_name_that_would_break_the_matcher_is_a_config_error(tmp_path, value):
    bad = tmp_path / "selectors.yaml"
    bad.write_text(f"agent_job: {value}\n")
    with pytest.raises(ConfigError) as err:
        load_rules(thresholds_file=bad)
    assert err.value.key == AGENT_JOB and err.value.line == 1


def test_the_embedded_engine_labels_its_scrapes_with_the_rules_job(renamed):
    with socket.socket() as s:  # a port nothing listens on: the agent is down
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert Scraper(History(), []).job == DEFAULT_JOB
    history = History()
    engine = Engine(load_rules(thresholds_file=renamed), history)
    loop = EngineLoop(engine, Scraper(history, [f"127.0.0.1:{port}"], timeout=1), 15)
    for t in (0, 15, 30, 45):
        loop.tick(t)
    assert [(a.name, a.labels["job"]) for a in engine.firing()] == [
        ("TrainwatchAgentDown", "gpu-node-exporter")]
