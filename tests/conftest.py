"""Shared test helpers: real torchrun jobs with scratch files in the test's folders, real tmpfs mounts."""

import contextlib
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


@contextlib.contextmanager
def tmpfs_mount(path: Path, size: str):
    """A real tmpfs of ``size`` at ``path`` (root only; the test skips elsewhere), unmounted after."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
