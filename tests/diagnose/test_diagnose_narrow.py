"""`trainwatch diagnose` read in an 80-column terminal or a pipe (rich's default width):
the rank table's rank, pid and state are whole; long cells wrap instead."""

import os
import subprocess
import sys

import pytest

from conftest import REPO
from diagnose_helpers import Job

pytestmark = pytest.mark.slow


def test_rank_table_keeps_pids_whole_in_80_columns(tmp_path):
    job = Job(tmp_path)
    try:
        statuses = job.wait_step(3)
        out = subprocess.run([sys.executable, "-m", "trainwatch", "diagnose", str(job.run.root)],
                             capture_output=True, text=True, timeout=60, cwd=REPO,
                             env={**os.environ, "COLUMNS": "80"})
    finally:
        job.stop()
    assert out.returncode in (0, 1), out.stderr
    table = out.stdout.split("Ranks", 1)[1]
    assert max(len(line) for line in table.splitlines()) <= 80, table
    for s in statuses.values():
        assert f" {s['pid']} " in table, table
    assert "running" in table, table
