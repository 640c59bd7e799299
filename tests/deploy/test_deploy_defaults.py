"""The shipped configs restate the code's defaults only as the code has them.

deploy/agent.yaml shows every agent setting with its default, so operators see them; the
scrape, webhook and Kubernetes configs name the agent's and the receiver's default
addresses. The code is the home of those values (the agent's config model and collector
registrations, trainwatch/contract/ports.py): these tests keep the copies from drifting.
(The preflight defaults need no such test: trainwatch/preflight/defaults.yaml is their home.)
"""

import re
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from trainwatch.agent.config import agent_settings_model
from trainwatch.alerts.rules import AGENT_JOB, load_thresholds
from trainwatch.contract.ports import AGENT_LISTEN, AGENT_PORT, RECEIVER_LISTEN

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
AGENT_YAML = DEPLOY / "agent.yaml"
# The settings deploy/agent.yaml sets on purpose, not restating a default (its header says so).
SET_ON_PURPOSE = {"discover": ["/var/lib/trainwatch/runs"]}


def _flatten(value, path=()):
    """Dotted keys to leaf values: `stall.phase_budgets.eval: 300`."""
    if isinstance(value, dict) and value:
        for key, item in value.items():
            yield from _flatten(item, path + (key,))
    else:
        yield ".".join(path), value


def _defaults():
    return dict(_flatten(agent_settings_model()().model_dump()))


def test_every_value_deploy_agent_yaml_shows_is_the_codes_default():
    shown = dict(_flatten(yaml.safe_load(AGENT_YAML.read_text())))
    defaults = _defaults()
    assert set(shown) <= set(defaults), "keys the agent does not know"
    differ = {key: (value, defaults[key]) for key, value in shown.items()
              if key not in SET_ON_PURPOSE and not _same(value, defaults[key])}
    assert differ == {}, "deploy/agent.yaml (shown, code default)"
    assert {key: shown[key] for key in SET_ON_PURPOSE} == SET_ON_PURPOSE


def test_deploy_agent_yaml_shows_every_setting():
    shown = dict(_flatten(yaml.safe_load(AGENT_YAML.read_text())))
    missing = set(_defaults()) - set(shown) - {"node"}
    assert missing == set(), "settings deploy/agent.yaml does not show"
    # `node` has no fixed default (the hostname): shown as a comment
    assert re.search(r"^# node: ", AGENT_YAML.read_text(), re.M)


def _same(shown, default):
    """YAML's 5 is the model's 5.0; a bool is never a number."""
    if isinstance(shown, bool) or isinstance(default, bool):
        return shown is default
    return shown == default


def test_the_shipped_scrape_and_webhook_configs_name_the_default_addresses():
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {job["job_name"]: [t for c in job["static_configs"] for t in c["targets"]]
               for job in prometheus["scrape_configs"]}
    assert targets[load_thresholds()[AGENT_JOB]] == [AGENT_LISTEN]
    assert targets["trainwatch-receiver"] == [RECEIVER_LISTEN]
    alertmanager = yaml.safe_load((DEPLOY / "alertmanager" / "alertmanager.yml").read_text())
    actions = next(r for r in alertmanager["receivers"] if r["name"] == "trainwatch-actions")
    hooks = [urlsplit(hook["url"]) for hook in actions["webhook_configs"]]
    assert [(u.netloc, u.path) for u in hooks] == [(RECEIVER_LISTEN, "/webhook")]


def test_the_kubernetes_agent_serves_on_the_default_port():
    base = DEPLOY / "kubernetes" / "base"
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all((base / "agent.yaml").read_text())
            if doc}
    container = docs["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]
    assert [p["containerPort"] for p in container["ports"]] == [AGENT_PORT]
    assert [p["port"] for p in docs["Service"]["spec"]["ports"]] == [AGENT_PORT]
    config = yaml.safe_load((base / "agent-config.yaml").read_text())
    assert config["listen"].rpartition(":")[2] == str(AGENT_PORT)
