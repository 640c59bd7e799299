"""Checks shared by the kustomize tree and the Helm chart: the same validation for both.

Core kinds go through kubernetes-validate (offline schemas, strict: an unknown field fails).
It has no schemas for custom resources (prometheus-operator's, JobSet): a PrometheusRule's
groups go through promtool, the others are checked field by field against the fields
their API reference lists, and a JobSet's Job template is validated as a batch/v1 Job.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainwatch.agent.config import build_config

kubernetes_validate = pytest.importorskip("kubernetes_validate")

OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "AlertmanagerConfig"}
CUSTOM_KINDS = OPERATOR_KINDS | {"JobSet"}
DURATION = re.compile(r"^(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?$")


class _GoYAML(yaml.SafeLoader):
    """PyYAML reads a plain ``=`` as YAML 1.1's "value" key (kustomize writes a matcher's
    ``matchType: =`` unquoted); Kubernetes reads it as the string it is."""


_GoYAML.add_constructor("tag:yaml.org,2002:value", lambda loader, node: node.value)


def yaml_of(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.load_all(text, Loader=_GoYAML) if d]


def render_kustomize(path: Path) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return yaml_of(out.stdout)


def validate_core(doc: dict, where: str) -> None:
    try:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise AssertionError(f"{where}: {doc['kind']}/{doc['metadata']['name']}: "
                             f"{exc.message} at {list(exc.path)}") from None


def by_kind_name(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def only_fields(obj: dict, allowed: set[str], where: str) -> None:
    unknown = set(obj) - allowed
    assert not unknown, f"{where}: fields the API does not have: {sorted(unknown)}"


_CHECKED_RULES: set[str] = set()


def check_promtool(rule: dict, tmp_path: Path) -> None:
    text = yaml.safe_dump(rule["spec"])
    if shutil.which("promtool") is None or text in _CHECKED_RULES:
        return
    groups = tmp_path / "rules.yaml"
    groups.write_text(text)
    out = subprocess.run(["promtool", "check", "rules", str(groups)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    _CHECKED_RULES.add(text)


def check_monitor(monitor: dict) -> None:
    """A ServiceMonitor or PodMonitor: its fields, default label handling, durations."""
    spec, kind = monitor["spec"], monitor["kind"]
    only_fields(spec, {"jobLabel", "selector", "namespaceSelector", "endpoints",
                       "podMetricsEndpoints", "podTargetLabels", "targetLabels"}, kind)
    endpoints = spec["endpoints" if kind == "ServiceMonitor" else "podMetricsEndpoints"]
    for e in endpoints:
        only_fields(e, {"port", "path", "interval", "scrapeTimeout", "relabelings",
                        "metricRelabelings", "honorLabels", "scheme"}, f"{kind} endpoint")
        assert not e.get("honorLabels")
        assert DURATION.match(e["interval"]) and DURATION.match(e["scrapeTimeout"])
        for r in e.get("relabelings", []):
            only_fields(r, {"sourceLabels", "targetLabel", "regex", "action", "replacement",
                            "separator", "modulus"}, f"{kind} relabeling")


def check_agent_fits(docs: list[dict]) -> dict:
    """The agent DaemonSet, its Service, ServiceMonitor and config agree; returns its pod."""
    kinds = {d["kind"]: d for d in docs if d["kind"] != "PodMonitor"}
    ds, svc, sm = kinds["DaemonSet"], kinds["Service"], kinds.get("ServiceMonitor")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    if sm is not None:
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
        # job = the Service's app.kubernetes.io/name: what TrainwatchAgentDown selects
        assert svc["metadata"]["labels"][sm["spec"]["jobLabel"]] == "trainwatch-agent"
    pod = ds["spec"]["template"]["spec"]
    container = pod["containers"][0]
    cfg = build_config(yaml.safe_load(kinds["ConfigMap"]["data"]["agent.yaml"]), file="cm")
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert cfg.sys_root in mounts and cfg.proc_root in mounts
    assert cfg.discover[0] in mounts
    assert cfg.host_port[1] == container["ports"][0]["containerPort"]
    node = next(e for e in container["env"] if e["name"] == "TRAINWATCH_NODE")
    assert node["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    assert pod["automountServiceAccountToken"] is False
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"]
    assert sc["capabilities"]["drop"] == ["ALL"]
    runs = next(m for m in container["volumeMounts"] if m["name"] == "runs")
    assert runs["readOnly"] is True
    return pod


def runs_volume(pod: dict) -> dict:
    return next(v for v in pod["volumes"] if v["name"] == "runs")


def check_core_and_custom(docs: list[tuple[str, dict]], tmp_path: Path) -> None:
    """Every core resource against its schema, every custom one field by field."""
    for where, doc in docs:
        kind = doc["kind"]
        if kind not in CUSTOM_KINDS:
            validate_core(doc, where)
        elif kind in {"ServiceMonitor", "PodMonitor"}:
            check_monitor(doc)
        elif kind == "PrometheusRule":
            check_promtool(doc, tmp_path)
        assert kind != "Secret", f"{where}: a Secret in the manifests (create it with kubectl)"
