"""deploy/: the systemd unit verifies, the Kubernetes manifests hang together, the Slurm
scripts create and retire run directories the agent discovers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainwatch.agent.config import build_config
from trainwatch.rundir import iter_run_dirs

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def test_systemd_unit_is_hardened_and_verifies(tmp_path):
    text = (DEPLOY / "systemd" / "trainwatch-agent.service").read_text()
    for line in ("User=trainwatch", "NoNewPrivileges=yes", "ProtectSystem=strict",
                 "Restart=on-failure", "ExecReload=/bin/kill -HUP $MAINPID",
                 "CapabilityBoundingSet=\n"):
        assert line in text
    verify = shutil.which("systemd-analyze")
    if verify is None:
        pytest.skip("systemd-analyze is not installed")
    unit = tmp_path / "trainwatch-agent.service"  # point ExecStart at this checkout's CLI
    exe = Path(sys.executable).with_name("trainwatch")
    unit.write_text(text.replace("/usr/local/bin/trainwatch", str(exe)))
    out = subprocess.run([verify, "verify", str(unit)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_kubernetes_manifests_fit_together():
    docs = [d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "agent.yaml").read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert {"DaemonSet", "Service", "ServiceMonitor", "ConfigMap"} <= set(by_kind)
    ds, svc, sm = by_kind["DaemonSet"], by_kind["Service"], by_kind["ServiceMonitor"]
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and pod["securityContext"]["runAsNonRoot"] is True
    container = pod["containers"][0]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    cfg = build_config(yaml.safe_load(by_kind["ConfigMap"]["data"]["agent.yaml"]), file="cm")
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert cfg.sys_root in mounts and cfg.proc_root in mounts
    assert cfg.discover[0] in mounts


def test_slurm_prolog_and_epilog_manage_discoverable_run_dirs(tmp_path):
    env = {**os.environ, "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "llm",
           "TRAINWATCH_RUNS_ROOT": str(tmp_path / "runs"),
           "TRAINWATCH_ARCHIVE": str(tmp_path / "finished")}
    subprocess.run(["bash", str(DEPLOY / "slurm" / "prolog.sh")], env=env, check=True)
    assert [r.root.name for r in iter_run_dirs(tmp_path / "runs")] == ["slurm-4242"]
    out = subprocess.run(["bash", str(DEPLOY / "slurm" / "task_prolog.sh")], env=env,
                         check=True, capture_output=True, text=True).stdout
    assert f"export TRAINWATCH_RUN_DIR={tmp_path}/runs/slurm-4242" in out
    subprocess.run(["bash", str(DEPLOY / "slurm" / "epilog.sh")], env=env, check=True)
    assert list(iter_run_dirs(tmp_path / "runs")) == []
    assert (tmp_path / "finished" / "slurm-4242" / "status").is_dir()
