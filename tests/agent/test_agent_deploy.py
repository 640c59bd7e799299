"""deploy/: the systemd unit verifies, the Slurm scripts create and retire run directories
the agent discovers (the Kubernetes manifests: tests/deploy/test_deploy_kubernetes.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainwatch.rundir.run_dir import iter_run_dirs

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_systemd_unit_is_hardened_and_verifies(tmp_path):
    text = (DEPLOY / "systemd" / "trainwatch-agent.service").read_text()
    for line in ("User=trainwatch", "NoNewPrivileges=yes", "ProtectSystem=strict",
                 "Restart=on-failure", "ExecReload=/bin/kill -HUP $MAINPID",
                 "CapabilityBoundingSet=CAP_SYS_PTRACE\n"):
        assert line in text
    verify = shutil.which("systemd-analyze")
    if verify is None:
        pytest.skip("systemd-analyze is not installed")
    unit = tmp_path / "trainwatch-agent.service"  # point ExecStart at this checkout's CLI
    exe = Path(sys.executable).with_name("trainwatch")
    unit.write_text(text.replace("/usr/local/bin/trainwatch", str(exe)))
    out = subprocess.run([verify, "verify", str(unit)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_slurm_prolog_and_epilog_manage_discoverable_run_dirs(tmp_path):
    env = {**os.environ, "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "llm",
           "TRAINWATCH_RUNS_ROOT": str(tmp_path / "runs"),
           "TRAINWATCH_ARCHIVE": str(tmp_path / "finished")}
    subprocess.run(["bash", str(DEPLOY / "slurm" / "prolog.sh")], env=env, check=True)
    assert [r.root.name for r in iter_run_dirs(tmp_path / "runs")] == ["slurm-4242"]
    out = subprocess.run(["bash", str(DEPLOY / "slurm" / "task_prolog.sh")], env=env,
                         check=True, capture_output=True, text=True).stdout
    assert f"export TRAINWATCH_RUN_DIR={tmp_path}/runs/slurm-4242" in out
    assert "export TRAINWATCH_JOB=slurm-4242\n" in out  # one name: the directory's
    subprocess.run(["bash", str(DEPLOY / "slurm" / "epilog.sh")], env=env, check=True)
    assert list(iter_run_dirs(tmp_path / "runs")) == []
    assert (tmp_path / "finished" / "slurm-4242" / "status").is_dir()
