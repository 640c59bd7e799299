"""A 2-rank FSDP job with the documented lines under `trainwatch run`: FSDP2 and FSDP1 are
protected.

Before: an FSDP2 job's async saves all failed (".numpy() is not supported for tensor
subclasses") while the job trained on; sync saves sealed rank 0's shards only (and hung in
the NaN guard), and a restart resumed from half the model. Now its DTensor state is saved
by every rank through DCP and the run ends with its checkpoints sealed. FSDP1's sharded
state was refused (exit 2, "shard with FSDP2"); now it is saved the same way (its
ShardedTensors, async too, every rank its own chunks), with memory snapshots off and the
reason journaled."""

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import kill_tree, torchrun_env
from trainwatch.checkpoint_format.catalog import scan
from trainwatch.rundir.run_dir import RunDir

pytestmark = pytest.mark.slow

JOB = Path(__file__).resolve().parents[1] / "jobs" / "fsdp2_job.py"


def _start(tmp_path: Path, run: RunDir, *args: str) -> subprocess.Popen:
    """`trainwatch run` of the job, its stdout and stderr each to a file in ``tmp_path``."""
    out, err = (open(tmp_path / name, "w") for name in ("stdout", "stderr"))
    with out, err:
        return subprocess.Popen(
            [sys.executable, "-m", "trainwatch", "run", "--run-dir", str(run.root), "--no-live",
             "--", "torchrun", "--standalone", "--nproc-per-node", "2", str(JOB), *args],
            stdout=out, stderr=err, text=True, env=torchrun_env(tmp_path))


def _done(tmp_path: Path, proc: subprocess.Popen) -> subprocess.CompletedProcess:
    proc.wait(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, *(
        (tmp_path / name).read_text() for name in ("stdout", "stderr")))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[RunDir, subprocess.CompletedProcess]]:
    """The FSDP2 and the FSDP1 job (10 steps, async saves), side by side: most of each
    run is its start-up, so neither waits for the other's."""
    jobs = {"fsdp2": (), "fsdp1": ("--fsdp1",)}
    folders = {name: tmp_path_factory.mktemp(name) for name in jobs}
    dirs = {name: RunDir(folders[name] / "run") for name in jobs}
    procs = {name: _start(folders[name], dirs[name], *flags, "--mode", "async", "--steps", "10")
             for name, flags in jobs.items()}
    try:
        return {name: (dirs[name], _done(folders[name], proc)) for name, proc in procs.items()}
    except BaseException:
        for proc in procs.values():
            kill_tree(proc)
        raise


def test_an_fsdp2_job_checkpoints_its_sharded_state_every_rank_its_own_shards(runs):
    run, proc = runs["fsdp2"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not run.events("checkpoint_failed"), run.events("checkpoint_failed")
    assert [(e["step"], e["mode"]) for e in run.events("checkpoint_saved")] == [
        (5, "async"), (10, "async")]
    (newest, _) = [e for folder in run.checkpoint_folders() for e in scan(folder)]
    assert newest.step == 10 and newest.manifest["layout"] == "dcp"
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(newest.manifest["files"])


def test_an_fsdp1_job_checkpoints_its_sharded_state_too(runs):
    run, proc = runs["fsdp1"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not run.events("checkpoint_failed"), run.events("checkpoint_failed")
    assert [(e["step"], e["mode"]) for e in run.events("checkpoint_saved")] == [
        (5, "async"), (10, "async")]
    (newest, _) = [e for folder in run.checkpoint_folders() for e in scan(folder)]
    assert newest.manifest["layout"] == "dcp" and newest.manifest["dcp"]["mesh"] is None
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(newest.manifest["files"])
    assert newest.manifest["dcp"]["placements"]["model.0.weight"] == [
        "[0:32, 0:32] on rank 0", "[32:64, 0:32] on rank 1"]
    (off,) = run.events("memory_snapshots_off")
    assert off["reason"].startswith("FSDP1 (FullyShardedDataParallel) state"), off
