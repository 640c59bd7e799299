"""Other users on this machine: one made for a test, and a python they may run."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from agent_helpers import REPO


def _ensure_user(name: str) -> None:
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--user-group", "--no-create-home",
                        "--shell", "/usr/sbin/nologin", name], check=True)


def _python_for_others() -> tuple[str, str]:
    """An interpreter other users may run, and the PYTHONPATH that gives it this
    environment's packages: this one if every folder above it is world-traversable, else
    the system's python of the same version (same ABI; pyenv builds live under 0700 /root)."""
    real = Path(os.path.realpath(sys.executable))
    paths = os.pathsep.join(dict.fromkeys([sysconfig.get_paths()["purelib"],
                                           sysconfig.get_paths()["platlib"], str(REPO)]))
    if all(p.stat().st_mode & 0o001 for p in real.parents):
        return str(real), paths
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    if not system.exists():
        pytest.skip(f"{real} is not reachable by other users and {system} does not exist")
    return str(system), paths
