"""A 2-rank FSDP2 job with the documented Checkpoints lines is refused as bad input.

Before: async saves all failed (".numpy() is not supported for tensor subclasses") while the
job trained on; sync saves sealed rank 0's shards only (and hung in the NaN guard), and a
restart resumed from half the model. Now the first save (sync, no resume) or the resume
(async) stops the ranks with the bad-input error naming the DTensor key and the fix:
`trainwatch run` exits 2, the job is started once, and no checkpoint is sealed."""

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import torchrun_env
from trainwatch.checkpoint_format.catalog import scan
from trainwatch.rundir.run_dir import RunDir

pytestmark = pytest.mark.slow

JOB = Path(__file__).resolve().parents[1] / "jobs" / "fsdp2_job.py"
SAID = "cannot checkpoint model.0.weight: DTensor (sharded over mesh ('dp',) with Shard(0))"


@pytest.mark.parametrize("mode, args, at_step", [("sync", ["--no-resume"], 4),
                                                 ("async", [], None)])
def test_an_fsdp2_job_is_refused_at_its_first_save_or_resume_not_restarted(
        tmp_path, mode, args, at_step):
    run = RunDir(tmp_path / "run")
    proc = subprocess.run(
        [sys.executable, "-m", "trainwatch", "run", "--run-dir", str(run.root), "--no-live",
         "--", "torchrun", "--standalone", "--nproc-per-node", "2", str(JOB), "--mode", mode,
         *args],
        capture_output=True, text=True, timeout=300, env=torchrun_env(tmp_path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "rejected its input (exit 2): rank " in proc.stderr, proc.stderr
    assert SAID in proc.stderr and "torch.distributed.checkpoint (DCP)" in proc.stderr
    assert len(run.events("job_started")) == 1, run.events("job_started")
    assert not run.events("action_taken") and not run.events("restarted")
    assert not run.events("checkpoint_saved") and not run.events("checkpoint_failed")
    assert not [e for folder in run.checkpoint_folders() for e in scan(folder)]
    statuses = run.statuses().records
    refused = [s for s in statuses if (s.get("failure") or {}).get("kind") == "bad_input"]
    assert refused, statuses
    # sync: the ranks trained steps 0-4 and stopped at the save of step 5; async: at resume.
    assert {s.get("step") for s in refused} == {at_step}, statuses
