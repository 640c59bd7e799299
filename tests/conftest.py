"""Shared test helpers: run real torchrun jobs with scratch files inside the test's folders."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def torchrun_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Environment for a torchrun child: TMPDIR in the test's own folder, quiet OMP."""
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    env = dict(os.environ)
    env.update({"TMPDIR": str(scratch), "OMP_NUM_THREADS": "1",
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def run_torchrun(tmp_path: Path, script: str, *args: str, nproc: int = 2,
                 timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", script, *args]
    return subprocess.run(cmd, env=torchrun_env(tmp_path), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


@pytest.fixture
def repo() -> Path:
    return REPO
