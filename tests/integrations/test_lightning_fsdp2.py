"""Lightning's ModelParallelStrategy (FSDP2: ``fully_shard`` in ``configure_model``) with
trainwatch's callback, 2 CPU ranks under torchrun (gloo). Every save crashed rank 0 with
"a folder inside a checkpoint cannot be sealed" (the strategy writes the checkpoint as a
folder of DCP shards) and the job restarted from step 0 until the restart guard gave up.
Now each save is sealed with every rank's shard, listed as sharded and verified; a damaged
newest one (a rank's shard deleted) is passed over, and the run resumed from the one before
ends with the same full model and AdamW state, bit for bit, as a run that never stopped."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainwatch.checkpoint_format.manifest import read_manifest
from trainwatch.rundir.run_dir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None, reason="needs lightning")]
JOB = Path(__file__).resolve().parent.parent / "jobs" / "lightning_fsdp2_job.py"


def _torchrun(run: RunDir, out: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(JOB), "6", "3", str(out)], capture_output=True, text=True, timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TRAINWATCH_RUN_DIR": str(run.root)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _checkpoint(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainwatch", "checkpoint", *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})


def test_fsdp2_checkpoints_are_sealed_verified_and_resume_exactly(tmp_path):
    run, out = RunDir(tmp_path / "run"), tmp_path / "digests.jsonl"
    _torchrun(run, out)  # 6 steps (an epoch is 3), saved at 3 and 6
    steps = [run.checkpoint_dir / f"step-0000000{n}" for n in (3, 6)]
    manifest = read_manifest(steps[1])
    assert manifest["layout"] == "dcp" and manifest["framework"] == "lightning"
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"} <= set(manifest["files"])
    listed = _checkpoint("list", str(run.root))
    assert listed.stdout.count("sharded, 2 DCP shards") == 2, listed.stdout
    assert _checkpoint("verify", str(run.root)).returncode == 0

    (steps[1] / "__1_0.distcp").unlink()  # rank 1's shard of the newest checkpoint is lost
    bad = _checkpoint("verify", str(steps[1]))
    assert bad.returncode == 1 and "__1_0.distcp: missing" in bad.stdout, bad.stdout
    _torchrun(run, out)  # resumes from step 3, trains to 6 again
    clean, resumed = (json.loads(line) for line in out.read_text().splitlines())
    assert (clean["resumed_at"], resumed["resumed_at"]) == (0, 3)
    assert resumed["step"] == clean["step"] == 6
    assert resumed["digest"] == clean["digest"]
    used = [e for e in run.events("checkpoint_resumed") if e.get("framework") == "lightning"]
    assert used and used[-1]["path"] == str(steps[0])
