"""The Helm chart (deploy/helm/trainwatch), rendered and linted by Helm's own engine (the
Helm v4 Go SDK that helm-python-sdk binds; no helm binary here), then validated as the
kustomize tree is (tests/kubernetes_helpers.py): kubernetes-validate strict, the monitors
field by field, the rules through promtool, the agent's pieces fitting together.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.kubernetes_helpers import (
    by_kind_name,
    check_agent_fits,
    check_core_and_custom,
    render_kustomize,
    runs_volume,
    yaml_of,
)

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "trainwatch"
try:
    import helm_python as helm
except ImportError:
    if os.environ.get("CI"):
        raise  # CI installs it (pyproject's test extra): never skip there
    pytest.skip("needs helm-python-sdk (pip install -e '.[test]')", allow_module_level=True)

EVERY_KNOB = {
    "image": {"repository": "registry.example.com/ml/trainwatch", "tag": "0.1.0-cu124",
              "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "agent": {
        "runsGroup": 3500,
        "nodeSelector": {"nvidia.com/gpu.present": "true"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "resources": {"requests": {"cpu": "50m", "memory": "96Mi"},
                      "limits": {"cpu": "500m", "memory": "512Mi"}},
        "priorityClassName": "system-cluster-critical",
        "runtimeClassName": "nvidia",
        "extraEnv": [{"name": "TRAINWATCH_LOG", "value": "debug"}],
        "extraVolumes": [{"name": "ca", "configMap": {"name": "corp-ca"}}],
        "extraVolumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True}],
        "runsVolume": {"persistentVolumeClaim": {"claimName": "trainwatch-runs",
                                                 "readOnly": True}},
        "config": {"collectors": {"storage": {"probe": False}}, "stall": {"floor_seconds": 10}},
    },
    "serviceMonitor": {"labels": {"release": "kube-prometheus-stack"}},
    "podMonitor": {"enabled": True},
    "prometheusRule": {"runbookBase": "https://wiki.example.com/ml/trainwatch"},
}


def _render(values: dict | None = None) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values or {})
        out = chart.render(values, name="trainwatch", namespace="trainwatch", is_install=True)
    return [d for text in out.values() for d in yaml_of(text)]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {"defaults": _render(), "every knob": _render(EVERY_KNOB),
            "no monitors": _render({"serviceMonitor": {"enabled": False},
                                    "prometheusRule": {"enabled": False}})}


def test_chart_lints_clean_and_renders_valid_manifests(rendered, tmp_path):
    report = helm.lint(str(CHART), strict=True)
    assert report["errors"] == [] and all(m["severity"] < 2 for m in report["messages"]), report
    docs = [(name, d) for name, ds in rendered.items() for d in ds]
    check_core_and_custom(docs, tmp_path)
    for ds in rendered.values():
        check_agent_fits(ds)
    kinds = {name: sorted(d["kind"] for d in ds) for name, ds in rendered.items()}
    assert kinds["defaults"] == ["ConfigMap", "DaemonSet", "PrometheusRule", "Service",
                                 "ServiceAccount", "ServiceMonitor"]
    assert "PodMonitor" in kinds["every knob"]
    assert not {"ServiceMonitor", "PrometheusRule"} & set(kinds["no monitors"])


def test_chart_defaults_render_what_the_kustomize_base_ships(rendered):
    """One agent, two ways to install it: the same pod, rules and scrape."""
    chart = by_kind_name(rendered["defaults"])
    base = by_kind_name(render_kustomize(REPO / "deploy" / "kubernetes" / "base"))
    rule, base_rule = chart[("PrometheusRule", "trainwatch")], base[("PrometheusRule", "trainwatch")]
    assert rule["spec"] == base_rule["spec"]
    pod = chart[("DaemonSet", "trainwatch-agent")]["spec"]["template"]["spec"]
    base_pod = base[("DaemonSet", "trainwatch-agent")]["spec"]["template"]["spec"]
    for key in ("hostPID", "securityContext", "tolerations", "priorityClassName"):
        assert pod[key] == base_pod[key], key
    # the same volumes (kustomize's ConfigMap has a hash suffix) and agent config
    assert [v for v in pod["volumes"] if v["name"] != "config"] == \
        [v for v in base_pod["volumes"] if v["name"] != "config"]
    config, base_config = (next(d for k, d in docs.items() if k[0] == "ConfigMap")
                           for docs in (chart, base))
    assert yaml_of(config["data"]["agent.yaml"]) == yaml_of(base_config["data"]["agent.yaml"])
    (c,), (bc,) = pod["containers"], base_pod["containers"]
    for key in ("args", "env", "ports", "resources", "securityContext", "volumeMounts"):
        assert c[key] == bc[key], key
    sm, base_sm = chart[("ServiceMonitor", "trainwatch-agent")], \
        base[("ServiceMonitor", "trainwatch-agent")]
    assert sm["spec"]["endpoints"] == base_sm["spec"]["endpoints"]


def test_every_value_reaches_the_manifests(rendered):
    docs = by_kind_name(rendered["every knob"])
    pod = docs[("DaemonSet", "trainwatch-agent")]["spec"]["template"]["spec"]
    agent = EVERY_KNOB["agent"]
    assert pod["nodeSelector"] == agent["nodeSelector"]
    assert pod["tolerations"] == agent["tolerations"]
    assert pod["priorityClassName"] == agent["priorityClassName"]
    assert pod["runtimeClassName"] == "nvidia" and pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["securityContext"]["supplementalGroups"] == [3500]
    (c,) = pod["containers"]
    assert c["image"] == "registry.example.com/ml/trainwatch:0.1.0-cu124"
    assert c["resources"] == agent["resources"]
    assert {"name": "TRAINWATCH_LOG", "value": "debug"} in c["env"]
    assert {"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True} in c["volumeMounts"]
    assert {"name": "ca", "configMap": {"name": "corp-ca"}} in pod["volumes"]
    assert runs_volume(pod) == {"name": "runs", **agent["runsVolume"]}
    cm = yaml_of(docs[("ConfigMap", "trainwatch-agent")]["data"]["agent.yaml"])[0]
    assert cm["stall"] == {"floor_seconds": 10} and cm["discover"] == ["/var/lib/trainwatch/runs"]
    assert docs[("ServiceMonitor", "trainwatch-agent")]["metadata"]["labels"]["release"] \
        == "kube-prometheus-stack"
    urls = [r["annotations"]["runbook_url"] for g in
            docs[("PrometheusRule", "trainwatch")]["spec"]["groups"] for r in g["rules"]]
    assert urls and all(u.startswith("https://wiki.example.com/ml/trainwatch/runbooks/")
                        for u in urls)


def test_a_wrong_value_is_refused_naming_it():
    with helm.Chart.load(CHART) as chart:
        for values, named in (({"agent": {"runsGroup": "trainwatch"}}, "runsGroup"),
                              ({"agent": {"tolerance": []}}, "tolerance"),
                              ({"serviceMonitor": {"interval": "5 seconds"}}, "interval")):
            with pytest.raises(helm.HelmValuesError, match=named):
                chart.validate_schema(values)
