"""A 2-rank FSDP job with the documented lines under `trainwatch run`: FSDP2 is protected,
FSDP1 is refused as bad input.

Before: an FSDP2 job's async saves all failed (".numpy() is not supported for tensor
subclasses") while the job trained on; sync saves sealed rank 0's shards only (and hung in
the NaN guard), and a restart resumed from half the model. Now its DTensor state is saved
by every rank through DCP and the run ends with its checkpoints sealed. FSDP1's sharded
state (not supported yet) stops the ranks at the first look at the state (the first memory
snapshot, or else the first save) with the bad-input error
naming the module and the fix: `trainwatch run` exits 2, the job is started once, and no
checkpoint is sealed."""

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import torchrun_env
from trainwatch.checkpoint_format.catalog import scan
from trainwatch.rundir.run_dir import RunDir

pytestmark = pytest.mark.slow

JOB = Path(__file__).resolve().parents[1] / "jobs" / "fsdp2_job.py"
SAID = "cannot checkpoint model: FSDP1 FullyShardedDataParallel"


def _run(tmp_path: Path, run: RunDir, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainwatch", "run", "--run-dir", str(run.root), "--no-live",
         "--", "torchrun", "--standalone", "--nproc-per-node", "2", str(JOB), *args],
        capture_output=True, text=True, timeout=300, env=torchrun_env(tmp_path))


def test_an_fsdp2_job_checkpoints_its_sharded_state_every_rank_its_own_shards(tmp_path):
    run = RunDir(tmp_path / "run")
    proc = _run(tmp_path, run, "--mode", "async", "--steps", "10")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not run.events("checkpoint_failed"), run.events("checkpoint_failed")
    assert [(e["step"], e["mode"]) for e in run.events("checkpoint_saved")] == [
        (5, "async"), (10, "async")]
    (newest, _) = [e for folder in run.checkpoint_folders() for e in scan(folder)]
    assert newest.step == 10 and newest.manifest["layout"] == "dcp"
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(newest.manifest["files"])


def test_an_fsdp1_job_is_refused_at_its_first_save_not_restarted(tmp_path):
    run = RunDir(tmp_path / "run")
    proc = _run(tmp_path, run, "--fsdp1", "--mode", "sync", "--no-resume")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "rejected its input (exit 2): rank " in proc.stderr, proc.stderr
    assert SAID in proc.stderr and "shard with FSDP2" in proc.stderr
    assert len(run.events("job_started")) == 1, run.events("job_started")
    assert not run.events("action_taken") and not run.events("restarted")
    assert not run.events("checkpoint_saved") and not run.events("checkpoint_failed")
    assert not [e for folder in run.checkpoint_folders() for e in scan(folder)]
    statuses = run.statuses().records
    refused = [s for s in statuses if (s.get("failure") or {}).get("kind") == "bad_input"]
    assert refused, statuses
    # the ranks trained step 0 and stopped at the first look at the state: the memory
    # snapshot of step 1 (memory_snapshots: auto), before the first save (step 5)
    assert {s.get("step") for s in refused} == {0}, statuses
