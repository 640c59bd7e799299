"""Exact resume through `trainwatch train`: real torchrun, two gloo ranks, real SIGKILL and
SIGTERM, corrupted checkpoints.  Every interrupted run must end with the same weights
(`trainwatch checkpoint digest`) as one that never stopped."""

import json
import shutil
import signal
import time

import pytest

from conftest import finish, kill_tree, start_train
from trainwatch.rundir.run_dir import RunDir

# 20 kB of corpus gives 17 batches per rank and epoch: checkpoints at 10 and 20 are
# mid-epoch and the 30 steps cross an epoch boundary.  Dropout makes the RNG matter.
ARGS = ["--nproc-per-node", "2", "--steps", "30", "--set", "checkpoint.every_steps=10",
        "--set", "train.eval_interval=10", "--set", "model.dropout=0.1",
        "--set", "data.corpus_bytes=20000", "--set", "telemetry.heartbeat_interval=0.2"]


def start(run_dir, *extra, fault=None):
    return start_train("--run-dir", str(run_dir), *ARGS, *extra,
                       env={"TRAINWATCH_FAULT": fault} if fault else None)


@pytest.fixture
def launch(launch_train):
    """``launch_train`` with this file's arguments and an optional fault."""
    def run(run_dir, *extra, fault=None):
        return launch_train("--run-dir", str(run_dir), *ARGS, *extra,
                            env={"TRAINWATCH_FAULT": fault} if fault else None)
    return run


def digest(run_dir):
    """What `trainwatch checkpoint digest RUN_DIR --json` prints (in-process: no torch start-up)."""
    from click.testing import CliRunner
    from trainwatch.rank.checkpoint.cli import checkpoint
    done = CliRunner().invoke(checkpoint, ["digest", "--json", str(run_dir)])
    assert done.exit_code == 0, done.output
    return json.loads(done.output)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """An uninterrupted run of the same length: the digest every other run must reach."""
    run_dir = tmp_path_factory.mktemp("baseline") / "run"
    proc = start(run_dir, "--max-restarts", "0")
    try:
        code, out = finish(proc)
    finally:
        kill_tree(proc)
    assert code == 0, out[-3000:]
    result = digest(run_dir)
    assert result["path"].endswith("step-00000030")
    return run_dir, result["digest"]


def events(run_dir, *names):
    return RunDir(run_dir).events(*names)


@pytest.mark.slow
def test_sigkill_restart_then_sigterm_stop_and_resume_end_identical(tmp_path, launch, baseline):
    """One run's troubled life: rank 1 is SIGKILLed in step 15, its memory snapshot of
    step 13 the newest (every 4 steps) and the durable checkpoint of step 10: rank 0's dying
    gasp of step 15 and rank 1's own part of it (its RNGs and data position) make the
    restart resume mid-epoch from step 15, nothing lost; in the restarted attempt SIGTERM
    stops it after a checkpoint; a second launch resumes from that one and finishes."""
    run_dir = tmp_path / "run"
    # The sleep only holds rank 1 at step 22 of the restarted attempt, so SIGTERM lands mid-run.
    proc = launch(run_dir, "--max-restarts", "1", "--set", "checkpoint.memory_snapshots_every=4",
                  fault="kill:rank=1:step=15,sleep:rank=1:step=22:seconds=3:attempt=1")
    deadline = time.time() + 240
    while not [e for e in events(run_dir, "fault_injected") if e["fault"] == "sleep"]:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.time() < deadline, "the restarted run never reached step 22"
        time.sleep(0.2)
    resumed = events(run_dir, "checkpoint_resumed")
    assert [(e["step"], e["state_from"]) for e in resumed] == [(15, "dying gasp")]
    assert resumed[0]["durable_step"] == 10 and resumed[0]["steps_lost"] == 0
    (gasp,) = events(run_dir, "memory_snapshot_gasp")
    assert gasp["rank"] == 0 and gasp["step"] == 15 and gasp["written"], gasp
    # Mid-epoch (15 of 17 batches): the end's digest shows rank 1's own RNGs and data
    # position came back with rank 0's model and optimizer.
    proc.send_signal(signal.SIGTERM)
    code, out = finish(proc)
    assert code == 128 + signal.SIGTERM, out[-3000:]
    stop = [e for e in events(run_dir, "checkpoint_saved") if e.get("reason") == "stop"]
    assert len(stop) == 1 and 22 < stop[0]["step"] < 30
    requested = events(run_dir, "checkpoint_requested")
    assert all(e["step"] == stop[0]["step"] for e in requested)
    assert [e["sources"] for e in requested if e["rank"] == 1] == [["SIGTERM"]]
    assert {s["state"] for s in RunDir(run_dir).statuses().records} == {"stopped"}

    code, out = finish(launch(run_dir, "--max-restarts", "0"))
    assert code == 0, out[-3000:]
    assert events(run_dir, "checkpoint_resumed")[-1]["step"] == stop[0]["step"]
    assert digest(run_dir)["digest"] == baseline[1]


@pytest.mark.slow
def test_corrupt_newest_falls_back_and_still_ends_identical(tmp_path, launch, baseline):
    run_dir = tmp_path / "run"
    shutil.copytree(baseline[0], run_dir, ignore=shutil.ignore_patterns("status", "tmp"))
    newest = run_dir / "checkpoints/step-00000030/model.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01                       # one flipped bit
    newest.write_bytes(bytes(data))
    code, out = finish(launch(run_dir, "--max-restarts", "0"))
    assert code == 0, out[-3000:]
    fallback = events(run_dir, "checkpoint_fallback")
    assert len(fallback) == 1 and "model.pt: xxh3_128 mismatch" in fallback[0]["reason"]
    assert events(run_dir, "checkpoint_resumed")[-1]["step"] == 20
    assert digest(run_dir)["digest"] == baseline[1]   # step 30 rewritten, bit for bit
