"""A user's 2-rank FSDP2 loop with the documented Checkpoints lines is protected.

Memory snapshots: the same loop with a durable interval of 10 has rank 1 SIGKILLed
before step 7 (no checkpoint step); torchrun restarts both ranks and they resume from their
memory snapshots of their own shards (step 6 or 7: at most one step lost), the gathered
state there bit-identical to what the first attempt had at that step, and train the next
step again identically. (Before, sharded state took no memory snapshots and this restart
began at step 0.) That first attempt, uninterrupted up to step 7, is the clean run the
other jobs are compared with.

Before: every save of a DTensor model failed (or sealed rank 0's half of it) and a killed
rank restarted from step 0 or from half the weights. Now, with real torchrun gloo jobs
(tests/jobs/fsdp2_train.py): a rank SIGKILLed after the save of step 4, its shard of it
torn, is restarted by torchrun; both ranks verify their own files of step 4 in parallel
(parallel_verify.py), fall back past it on rank 1's verdict and resume from step 2 with the
gathered full model + optimizer state equal to the clean run's, there and at step 6;
`trainwatch checkpoint verify` says OK, then BAD (exit 1) once a shard is corrupted or
deleted; and the same checkpoints resume at world size 1, falling back past the corrupt
one, resharded by DCP, and train on."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import kill_tree, torchrun_env
from trainwatch.rank.checkpoint.cli import checkpoint
from trainwatch.rundir.run_dir import RunDir

pytestmark = pytest.mark.slow

JOB = Path(__file__).resolve().parents[1] / "jobs" / "fsdp2_train.py"


def _start(tmp_path: Path, name: str, run: Path, *args: str, nproc: int = 2,
           restarts: int = 0) -> tuple[subprocess.Popen, Path]:
    """The job under torchrun, started; where it writes its digests."""
    out = tmp_path / name
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", f"--max-restarts={restarts}", "--monitor-interval=0.1",
           str(JOB), "--out", str(out), *args]
    proc = subprocess.Popen(cmd, env=torchrun_env(tmp_path, TRAINWATCH_RUN_DIR=str(run)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, out


def _digests(started: tuple[subprocess.Popen, Path]) -> dict[tuple[int, str], dict]:
    """Wait for the job; its digests by (step, what), the newest of each, and by (step,
    "uninterrupted") those its first attempt trained (before any kill)."""
    proc, out = started
    try:
        output, _ = proc.communicate(timeout=180)
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, output[-6000:]
    lines = [json.loads(line) for line in (out / "digests.jsonl").read_text().splitlines()]
    first = {(d["step"], "uninterrupted"): d for d in lines
             if d["what"] == "trained" and d["attempt"] == 0}
    return {**{(d["step"], d["what"]): d for d in lines}, **first}


def _verify(path: Path):
    return CliRunner().invoke(checkpoint, ["verify", str(path)])


def test_an_fsdp2_job_resumes_exactly_falls_back_past_a_bad_shard_and_reshards(tmp_path):
    run = RunDir(tmp_path / "run")
    # side by side: each job mostly waits (rendezvous, the restart), and it halves the wall time
    # The memory job's first attempt trains steps 1-7 uninterrupted: the clean run the
    # others are compared with (one job fewer than a separate clean run).
    memory = RunDir(tmp_path / "memory-run")
    started = [_start(tmp_path, "memory", memory.root, "--steps", "8", "--every", "10",
                      "--kill-at", "7", "--memory-snapshots", "every_step", restarts=1),
               _start(tmp_path, "killed", run.root, "--kill-at", "5", "--tear-shard",
                      "--memory-snapshots", "off", restarts=1)]
    try:
        from_memory, killed = (_digests(s) for s in started)
    finally:
        for proc, _ in started:
            kill_tree(proc)
    clean = {step: from_memory[(step, "uninterrupted")] for step in range(1, 8)}
    # rank 1 killed before step 7, no checkpoint before 10: both ranks resumed from their
    # snapshots of their own shards, one step lost at most, exactly where they had been
    (resumed,) = memory.events("checkpoint_resumed")
    assert resumed["state_from"] == "memory snapshot" and resumed["step"] in (6, 7), resumed
    assert "durable_step" not in resumed and not memory.events("memory_snapshots_off")
    step = resumed["step"]
    assert from_memory[(step, "resumed")]["digest"] == clean[step]["digest"]
    if step == 6:  # and trained step 7 again exactly as it had (weights and loss)
        again = from_memory[(7, "trained")]
        assert (again["attempt"], again["digest"], again["loss"]) == (
            1, clean[7]["digest"], clean[7]["loss"])
    assert [e["step"] for e in memory.events("checkpoint_saved")] == [8]
    # rank 1 died before step 5, its shard of step 4 torn: torchrun restarted both ranks,
    # rank 1 found its shard bad, and both resumed from step 2 (step 4 was written again)
    (torn,) = run.events("checkpoint_fallback")
    assert torn["path"].endswith("step-00000004") and torn["next"].endswith("step-00000002")
    assert torn["reason"] == "__1_0.distcp: xxh3_128 mismatch (content changed or corrupt)"
    assert [e["step"] for e in run.events("checkpoint_resumed")] == [2]
    assert {e["mode"] for e in run.events("checkpoint_saved")} == {"async"}
    assert killed[(2, "resumed")]["digest"] == clean[2]["digest"]
    assert killed[(6, "trained")]["digest"] == clean[6]["digest"]
    folder = run.checkpoint_dir
    assert sorted(p.name for p in folder.iterdir()) == [
        "step-00000002", "step-00000004", "step-00000006"]
    assert sorted(p.name for p in (folder / "step-00000006").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json", "rank-00000.pt",
        "rank-00001.pt"]
    good = _verify(run.root)
    assert good.exit_code == 0 and good.output.count("OK ") == 3, good.output

    shard = folder / "step-00000006" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (folder / "step-00000002" / "__0_0.distcp").unlink()
    bad = _verify(run.root)
    assert bad.exit_code == 1, bad.output
    assert "__1_0.distcp: xxh3_128 mismatch" in bad.output
    assert "__0_0.distcp: missing" in bad.output

    # the same checkpoints at world size 1: step 6 is passed over, step 4 resharded 2 -> 1
    one = _digests(_start(tmp_path, "one", run.root, "--steps", "8", nproc=1))
    (_, fallback) = run.events("checkpoint_fallback")
    assert fallback["path"].endswith("step-00000006") and "__1_0.distcp" in fallback["reason"]
    (resharded,) = run.events("checkpoint_resharded")
    assert (resharded["step"], resharded["from_world_size"], resharded["to_world_size"]) == (
        4, 2, 1)
    assert one[(4, "resumed")]["digest"] == clean[4]["digest"]
    assert one[(4, "resumed")]["world"] == 1 and one[(8, "trained")]["loss"] < 3.0
    # it went on from the global sample count: 8 steps of 8 samples, not 4 + 4 of one rank's
    (step8,) = [e for e in run.events("checkpoint_saved") if e["step"] == 8]
    manifest = json.loads((Path(step8["path"]) / "manifest.json").read_text())
    assert manifest["world_size"] == 1 and manifest["data_position"] == [{"samples": 64}]
    assert _verify(folder / "step-00000008").exit_code == 0
