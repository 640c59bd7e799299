"""The Kubernetes manifests: kustomize renders the base, the example overlay and the
multi-node job; every core resource passes kubernetes-validate (offline schemas, strict),
and the custom ones (prometheus-operator's, JobSet) say what the rest of trainwatch
expects, field by field (tests/kubernetes_helpers.py).

(tests/alerts/test_alert_rules.py keeps base/prometheusrule.yaml equal to the export.)
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from tests.kubernetes_helpers import (
    OPERATOR_KINDS,
    by_kind_name,
    check_agent_fits,
    check_core_and_custom,
    check_promtool,
    only_fields,
    render_kustomize,
    runs_volume,
    validate_core,
)
from trainwatch.control.cli import receive
from trainwatch.trainer.config import load_config

REPO = Path(__file__).resolve().parents[2]
KUBE = REPO / "deploy" / "kubernetes"
pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl missing")


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render_kustomize(KUBE / name) for name in ("base", "overlays/example",
                                                             "multinode")}


def test_every_manifest_passes_the_kubernetes_schemas_or_field_checks(rendered, tmp_path):
    plain = [KUBE / "preflight-initcontainer.yaml"]
    docs = [(name, d) for name, ds in rendered.items() for d in ds]
    docs += [(p.name, d) for p in plain for d in yaml.safe_load_all(p.read_text()) if d]
    assert len([d for _, d in docs if d["kind"] not in OPERATOR_KINDS | {"JobSet"}]) >= 13
    check_core_and_custom(docs, tmp_path)
    assert {d["kind"] for _, d in docs} >= {"DaemonSet", "Service", "ConfigMap", "JobSet",
                                            *OPERATOR_KINDS}


def test_overlay_sets_runbook_base_group_and_labels(rendered, tmp_path):
    docs = by_kind_name(rendered["overlays/example"])
    rule = docs[("PrometheusRule", "trainwatch")]
    urls = [r["annotations"]["runbook_url"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert urls and all(u.startswith("https://wiki.example.com/ml-platform/trainwatch/runbooks/")
                        and u.endswith(".md") for u in urls)
    assert not any(k == "ConfigMap" and n.startswith("trainwatch-settings") for k, n in docs)
    pod = docs[("DaemonSet", "trainwatch-agent")]["spec"]["template"]["spec"]
    assert pod["securityContext"]["supplementalGroups"] == [3500]
    check_promtool(rule, tmp_path)


def test_monitors_use_default_label_handling_and_the_agent_runs_unprivileged(rendered):
    docs = by_kind_name(rendered["base"])
    service = docs[("ServiceMonitor", "trainwatch-agent")]["spec"]
    assert all(not e.get("honorLabels") for e in service["endpoints"])
    assert service["endpoints"][0]["port"] == "metrics"
    ranks = docs[("PodMonitor", "trainwatch-ranks")]["spec"]
    assert all(not e.get("honorLabels") for e in ranks["podMetricsEndpoints"])
    pod = check_agent_fits(rendered["base"])
    assert pod["containers"][0]["securityContext"]["capabilities"] == {
        "drop": ["ALL"], "add": ["SYS_PTRACE"]}


def _jobset_pod(jobset: dict) -> tuple[dict, dict]:
    """The JobSet's fields its API has, its Job template validated as a batch/v1 Job."""
    spec = jobset["spec"]
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    only_fields(spec, {"replicatedJobs", "network", "failurePolicy", "successPolicy",
                       "startupPolicy", "suspend", "ttlSecondsAfterFinished", "managedBy",
                       "coordinator"}, "JobSet spec")
    only_fields(spec["network"], {"enableDNSHostnames", "subdomain",
                                  "publishNotReadyAddresses"}, "JobSet network")
    only_fields(spec["failurePolicy"], {"maxRestarts", "restartStrategy", "rules"},
                "JobSet failurePolicy")
    assert spec["successPolicy"]["operator"] in {"All", "Any"}
    (rjob,) = spec["replicatedJobs"]
    only_fields(rjob, {"name", "replicas", "template", "dependsOn", "groupName"},
                "replicatedJob")
    job = {"apiVersion": "batch/v1", "kind": "Job",
           "metadata": {"name": f"{jobset['metadata']['name']}-{rjob['name']}-0"},
           **rjob["template"]}
    validate_core(job, "multinode/jobset.yaml (its Job template)")
    return rjob, job["spec"]


def test_multinode_jobset_runs_one_supervisor_per_node_as_the_agent_sees_it(rendered, tmp_path):
    docs = rendered["multinode"]
    named = by_kind_name(docs)
    jobset = named[("JobSet", "train-exp1")]
    rjob, job = _jobset_pod(jobset)
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"]
    pod = job["template"]["spec"]
    (trainer,) = pod["containers"]
    env = {e["name"]: e for e in trainer["env"]}
    assert env["TRAINWATCH_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert "job-completion-index" in env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    # every $(VAR) of the command is defined, and trainwatch's own CLI accepts it
    used = set(re.findall(r"\$\((\w+)\)", " ".join(trainer["args"])))
    assert used <= set(env), used - set(env)
    args = [re.sub(r"\$\(\w+\)", lambda m: {"$(NODE_RANK)": "1"}.get(m[0], "10.0.0.7"), a)
            for a in trainer["args"]]
    assert args[:2] == ["alerts", "receive"]
    opts = receive.make_context("receive", args[2:]).params
    assert opts["nnodes"] == job["parallelism"] and opts["node_rank"] == 1
    net = jobset["spec"]["network"]
    host = f"{jobset['metadata']['name']}-{rjob['name']}-0-0.{net['subdomain']}"
    assert opts["rdzv_endpoint"].split(":")[0] == host and net["enableDNSHostnames"]
    # the run directory on the path the agent DaemonSet reads, on the same host path
    agent_pod = check_agent_fits(rendered["base"])
    mounts = {m["name"]: m for m in trainer["volumeMounts"]}
    assert str(opts["run_dir_opt"]).startswith(mounts["runs"]["mountPath"] + "/")
    assert runs_volume(pod)["hostPath"]["path"] == runs_volume(agent_pod)["hostPath"]["path"]
    assert "hostPID" not in pod  # the agent finds the ranks by pid and PID namespace
    # the trainer config comes from the ConfigMap the kustomization renders, and loads
    config_volume = next(v for v in pod["volumes"] if v["name"] == "train-config")
    config_map = named[("ConfigMap", config_volume["configMap"]["name"])]
    config_file = Path(opts["config"])
    assert str(config_file.parent) == mounts["train-config"]["mountPath"]
    local = tmp_path / config_file.name
    local.write_text(config_map["data"][config_file.name])
    assert load_config(local).train.steps > 0
    # least privilege: non-root, read-only root fs, no capability, no API token
    assert pod["securityContext"]["runAsNonRoot"] and pod["automountServiceAccountToken"] is False
    sc = trainer["securityContext"]
    assert sc == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                  "capabilities": {"drop": ["ALL"]}}
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 0 and job["backoffLimit"] == 0


def test_multinode_receiver_gets_the_runs_alerts_with_the_mounted_token(rendered):
    named = by_kind_name(rendered["multinode"])
    jobset = named[("JobSet", "train-exp1")]
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (trainer,) = pod["containers"]
    opts = receive.make_context("receive", [a.replace("$(NODE_RANK)", "0").replace(
        "$(POD_IP)", "10.0.0.7") for a in trainer["args"][2:]]).params
    svc = named[("Service", "train-exp1-receiver")]
    assert svc["spec"]["selector"] == {"jobset.sigs.k8s.io/jobset-name": "train-exp1"}
    (port,) = svc["spec"]["ports"]
    listen_port = int(opts["listen"].rsplit(":", 1)[1])
    assert {p["name"]: p["containerPort"] for p in trainer["ports"]}[port["targetPort"]] \
        == listen_port
    amc = named[("AlertmanagerConfig", "train-exp1")]
    assert amc["apiVersion"] == "monitoring.coreos.com/v1alpha1"
    spec = amc["spec"]
    only_fields(spec, {"route", "receivers", "inhibitRules", "timeIntervals",
                       "muteTimeIntervals"}, "AlertmanagerConfig spec")
    route = spec["route"]
    only_fields(route, {"receiver", "groupBy", "groupWait", "groupInterval", "repeatInterval",
                        "matchers", "continue", "routes", "muteTimeIntervals",
                        "activeTimeIntervals"}, "AlertmanagerConfig route")
    for m in route["matchers"]:
        only_fields(m, {"name", "value", "matchType", "regex"}, "matcher")
        assert m["matchType"] in {"=", "!=", "=~", "!~"}
    assert {"name": "run", "value": Path(opts["run_dir_opt"]).name, "matchType": "="} in \
        route["matchers"]
    assert {"alertname", "run"} <= set(route["groupBy"])
    (receiver,) = [r for r in spec["receivers"] if r["name"] == route["receiver"]]
    only_fields(receiver, {"name", "webhookConfigs"}, "AlertmanagerConfig receiver")
    (hook,) = receiver["webhookConfigs"]
    only_fields(hook, {"url", "urlSecret", "sendResolved", "httpConfig", "maxAlerts",
                       "timeout"}, "webhookConfig")
    ns = svc["metadata"]["namespace"]
    assert hook["url"] == f"http://{svc['metadata']['name']}.{ns}.svc:{port['port']}/webhook"
    auth = hook["httpConfig"]["authorization"]
    only_fields(auth, {"type", "credentials"}, "authorization")
    only_fields(auth["credentials"], {"name", "key", "optional"}, "credentials")
    # one Secret, referenced by Alertmanager and mounted where --token-file reads it
    token = next(v for v in pod["volumes"] if v["name"] == "token")["secret"]
    assert auth["type"] == "Bearer" and auth["credentials"]["name"] == token["secretName"]
    mount = next(m for m in trainer["volumeMounts"] if m["name"] == "token")
    assert opts["token_file"] == f"{mount['mountPath']}/{auth['credentials']['key']}"
    assert mount["readOnly"] and token["defaultMode"] == 0o440


def test_every_example_trainer_is_seen_by_the_agent(rendered):
    """Each example's trainer writes where the agent reads and names the agent's node,
    without the host's pids (the agent maps each rank's namespaced pid itself): issue 34's
    example had a PVC against the agent's hostPath and TRAINWATCH_NODE on its init
    container only, and needed hostPID on the trainer pods."""
    agent_pod = check_agent_fits(rendered["base"])
    assert agent_pod["hostPID"] is True  # the agent alone sees the host's pids
    agent_runs = runs_volume(agent_pod)["hostPath"]["path"]
    job = yaml.safe_load((KUBE / "preflight-initcontainer.yaml").read_text())
    jobset = by_kind_name(rendered["multinode"])[("JobSet", "train-exp1")]
    pods = [job["spec"]["template"]["spec"],
            jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]]
    for pod in pods:
        assert not pod.get("hostPID")
        assert runs_volume(pod)["hostPath"]["path"] == agent_runs
        for c in pod.get("initContainers", []) + pod["containers"]:
            env = {e["name"]: e.get("valueFrom") for e in c.get("env", [])}
            assert env.get("TRAINWATCH_NODE") == {"fieldRef": {"fieldPath": "spec.nodeName"}}, \
                c["name"]
            runs = next(m for m in c["volumeMounts"] if m["name"] == "runs")
            assert runs["mountPath"] == agent_runs and not runs.get("readOnly")
