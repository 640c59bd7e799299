"""The shipped systemd unit: hardened (systemd's own exposure score) and valid (verify)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deploy_configs import SYSTEMD_UNIT, unit_service_settings

pytestmark = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                reason="systemd-analyze is not installed")


def test_unit_exposure_is_at_most_2_5():
    out = subprocess.run(["systemd-analyze", "security", "--offline=true", str(SYSTEMD_UNIT)],
                         capture_output=True, text=True)
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out.stdout + out.stderr)
    assert match, out.stdout + out.stderr
    assert float(match.group(1)) <= 2.5, out.stdout


def test_unit_verifies_clean_with_the_installed_trainwatch(tmp_path):
    """``systemd-analyze verify`` checks that ExecStart exists: point it at this
    environment's trainwatch instead of /usr/local/bin; everything else as shipped."""
    exe = Path(sys.executable).with_name("trainwatch")  # the venv's console script
    if not exe.exists():
        pytest.skip("trainwatch is not installed as a command")
    unit = tmp_path / SYSTEMD_UNIT.name
    unit.write_text(SYSTEMD_UNIT.read_text().replace("/usr/local/bin/trainwatch", str(exe)))
    out = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                         text=True, cwd=tmp_path)
    assert out.returncode == 0 and not out.stderr.strip(), out.stdout + out.stderr


def test_unit_runs_unprivileged_with_only_the_ptrace_read_capability():
    unit = unit_service_settings()
    assert unit["User"] == unit["Group"] == "trainwatch"
    assert unit["AmbientCapabilities"] == unit["CapabilityBoundingSet"] == "CAP_SYS_PTRACE"
    assert unit["NoNewPrivileges"] == "yes" and unit["TasksMax"] == "128"
