"""`trainwatch train --set parallel.mode=fsdp` end to end: two real gloo ranks sharded by
FSDP2, one SIGKILLed after a checkpoint, torchrun restarting both, the run resuming from
that checkpoint and ending with the same final state as an uninterrupted run. Both runs
also take a NaN loss on rank 0 at step 2, which the non-finite guard skips on every rank.

The two runs go side by side (each mostly waits: rendezvous, the restart). Saves are sync
so the checkpoint of step 4 is sealed before rank 1 can reach step 5 (rank 0 seals it
before the collectives of step 4, which rank 1 needs to finish that step). "The same
final state" is the digests the manifests record of every shard file and rank file
(model, optimizer, schedule, each rank's RNGs and data position): byte for byte."""

import json
import subprocess
import sys

import pytest

from conftest import REPO, finish
from trainwatch.checkpoint_format.manifest import DIGEST, read_manifest
from trainwatch.rundir.run_dir import RunDir

STEPS = 8
SETS = ["parallel.mode=fsdp", "checkpoint.every_steps=2", "checkpoint.mode=sync",
        "checkpoint.fsync=false", "train.eval_interval=0", "data.corpus_bytes=100000"]
NOTE = "replica digests and the reduction checksum are off"
NAN = "nan:rank=0:step=2"


def _options(run_dir, restarts):
    return ["--nproc-per-node", "2", "--run-dir", str(run_dir), "--steps", str(STEPS),
            "--max-restarts", str(restarts), *[a for s in SETS for a in ("--set", s)]]


def _content(step_dir):
    """{file: digest} of what a checkpoint holds, less DCP's .metadata (it names the
    checkpoint's own path)."""
    manifest = read_manifest(step_dir)
    return {name: entry[DIGEST] for name, entry in manifest["files"].items()
            if name != ".metadata"}


@pytest.mark.slow
def test_fsdp_run_resumes_a_killed_rank_from_its_checkpoint_and_ends_as_a_clean_run(
        tmp_path, launch_train):
    clean_dir, killed_dir = tmp_path / "clean", tmp_path / "killed"
    clean = launch_train(*_options(clean_dir, 0), env={"TRAINWATCH_FAULT": NAN})
    killed = launch_train(*_options(killed_dir, 1),
                          env={"TRAINWATCH_FAULT": f"{NAN},kill:rank=1:step=5"})
    (clean_code, clean_out), (code, out) = finish(clean), finish(killed)
    assert clean_code == 0, clean_out[-4000:]
    assert code == 0, out[-4000:]
    assert out.count(NOTE) == 2 and clean_out.count(NOTE) == 1  # rank 0, once per attempt

    for run in (RunDir(clean_dir), RunDir(killed_dir)):  # the guard, sharded: step 2 skipped
        found = run.events("nonfinite_detected")  # rank 0's loss, every rank's gradients
        assert {(e["step"], e["action"]) for e in found} == {(2, "skipped")}
        assert 0 in {e["rank"] for e in found if e["this_rank_bad"]}
    run = RunDir(killed_dir)
    assert [(e["rank"], e["step"], e["fault"]) for e in run.events("fault_injected")] == [
        (0, 2, "nan"), (1, 5, "kill")]
    assert [e["restart_count"] for e in run.events("restarted")] == [1]
    (resumed,) = run.events("checkpoint_resumed")
    assert resumed["step"] == 4 and resumed["path"].endswith("step-00000004")
    for status in run.statuses().records:
        assert status["state"] == "finished" and status["step"] == STEPS - 1
        assert "replicas" not in status or not status["replicas"]

    final = killed_dir / "checkpoints" / f"step-{STEPS:08d}"
    manifest = read_manifest(final)
    assert manifest["layout"] == "dcp" and manifest["world_size"] == 2
    assert manifest["dcp"]["mesh"]["shape"] == [2]
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                         "rank-00000.pt", "rank-00001.pt"]
    # every checkpoint after the restart holds what the uninterrupted run's does
    for step in (6, STEPS):
        name = f"step-{step:08d}"
        assert _content(killed_dir / "checkpoints" / name) == _content(
            clean_dir / "checkpoints" / name), name

    # and plan sizes the trainer's fsdp checkpoint: the DCP files it really wrote
    real = sum(f.stat().st_size for f in final.iterdir())
    done = subprocess.run([sys.executable, "-m", "trainwatch", "plan", "--json", "--devices",
                           "2", "--device-type", "cpu", *[a for s in SETS for a in ("--set", s)]],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["spec"]["sharding"] == "full" and plan["trainer_mode"] == "fsdp"
    assert plan["storage"]["checkpoint_bytes"] == pytest.approx(real, rel=0.02)
