"""The Kubernetes manifests: kustomize renders the base and the example overlay, every
core resource passes kubernetes-validate (offline schemas, strict), and the
prometheus-operator resources say what the rest of trainwatch expects.

kubernetes-validate ships no schemas for prometheus-operator's kinds: the PrometheusRule's
groups go through promtool instead, and the monitors are checked field by field.
(tests/alerts/test_alert_rules.py keeps base/prometheusrule.yaml equal to the export.)
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from trainwatch.agent.config import build_config

kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parents[2]
KUBE = REPO / "deploy" / "kubernetes"
OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl missing")


def _render(path: Path) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _validate(doc: dict, where: str) -> None:
    try:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise AssertionError(f"{where}: {doc['kind']}/{doc['metadata']['name']}: "
                             f"{exc.message} at {list(exc.path)}") from None


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: _render(KUBE / name) for name in ("base", "overlays/example")}


def test_every_core_manifest_passes_the_kubernetes_schemas(rendered):
    plain = [KUBE / "preflight-initcontainer.yaml"]
    docs = [(name, d) for name, ds in rendered.items() for d in ds]
    docs += [(p.name, d) for p in plain for d in yaml.safe_load_all(p.read_text()) if d]
    core = [(w, d) for w, d in docs if d["kind"] not in OPERATOR_KINDS]
    assert len(core) >= 11
    for where, doc in core:
        _validate(doc, where)
    assert {d["kind"] for _, d in docs} >= {"DaemonSet", "Service", "ConfigMap", *OPERATOR_KINDS}


def test_overlay_sets_runbook_base_group_and_labels(rendered, tmp_path):
    docs = {(d["kind"], d["metadata"]["name"]): d for d in rendered["overlays/example"]}
    rule = docs[("PrometheusRule", "trainwatch")]
    urls = [r["annotations"]["runbook_url"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert urls and all(u.startswith("https://wiki.example.com/ml-platform/trainwatch/runbooks/")
                        and u.endswith(".md") for u in urls)
    assert not any(k == "ConfigMap" and n.startswith("trainwatch-settings") for k, n in docs)
    pod = docs[("DaemonSet", "trainwatch-agent")]["spec"]["template"]["spec"]
    assert pod["securityContext"]["supplementalGroups"] == [3500]
    if shutil.which("promtool"):
        groups = tmp_path / "rules.yaml"
        groups.write_text(yaml.safe_dump(rule["spec"]))
        out = subprocess.run(["promtool", "check", "rules", str(groups)], capture_output=True,
                             text=True)
        assert out.returncode == 0, out.stdout + out.stderr


def test_monitors_use_default_label_handling_and_the_agent_runs_unprivileged(rendered):
    docs = {(d["kind"], d["metadata"]["name"]): d for d in rendered["base"]}
    service = docs[("ServiceMonitor", "trainwatch-agent")]["spec"]
    assert all(not e.get("honorLabels") for e in service["endpoints"])
    assert service["endpoints"][0]["port"] == "metrics"
    ranks = docs[("PodMonitor", "trainwatch-ranks")]["spec"]
    assert all(not e.get("honorLabels") for e in ranks["podMetricsEndpoints"])
    pod = docs[("DaemonSet", "trainwatch-agent")]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    agent = pod["containers"][0]["securityContext"]
    assert agent["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE"]}
    assert agent["allowPrivilegeEscalation"] is False and agent["readOnlyRootFilesystem"]
    runs = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "runs")
    assert runs["readOnly"] is True


def test_base_resources_fit_together(rendered):
    docs = {d["kind"]: d for d in rendered["base"] if d["kind"] != "PodMonitor"}
    ds, svc, sm = docs["DaemonSet"], docs["Service"], docs["ServiceMonitor"]
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    container = ds["spec"]["template"]["spec"]["containers"][0]
    cfg = build_config(yaml.safe_load(docs["ConfigMap"]["data"]["agent.yaml"]), file="cm")
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert cfg.sys_root in mounts and cfg.proc_root in mounts
    assert cfg.discover[0] in mounts
