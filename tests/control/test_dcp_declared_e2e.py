"""`trainwatch run -- torchrun ... fsdp2_dcp_job.py`: a user's 2-rank FSDP2 loop that saves
with torch.distributed.checkpoint and declares each save. The run's summary lists the
checkpoints (it said "checkpoints none"), and `trainwatch checkpoint` lists and verifies
them as DCP checkpoints of two shard files each."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import kill_tree
from trainwatch.rank.checkpoint.cli import checkpoint

JOB = Path(__file__).resolve().parents[1] / "jobs" / "fsdp2_dcp_job.py"


@pytest.mark.slow
def test_a_declared_fsdp2_dcp_checkpoint_is_in_the_summary_and_verifies(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainwatch", "run", "--run-dir", str(run_dir), "--no-live", "--",
         sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(JOB), "4", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path),
             "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    try:
        out = proc.communicate(timeout=240)[0].decode(errors="replace")
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, out[-3000:]
    (row,) = [line for line in out.splitlines() if "checkpoints" in line]
    assert "2, newest at step 4 (DCP, declared by the job)" in row, out[-3000:]
    listed = json.loads(CliRunner().invoke(checkpoint, ["list", str(run_dir), "--json"]).output)
    assert [(e["step"], e["kind"], e["shards"], e["declared"]) for e in listed] == [
        (4, "dcp", 2, True), (2, "dcp", 2, True)]
    verified = CliRunner().invoke(checkpoint, ["verify", str(run_dir)])
    assert verified.exit_code == 0, verified.output
    assert verified.output.count("OK ") == 2
