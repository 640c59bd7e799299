"""control/skip-steps.json: the trainer drops a rollback's window of batches, the same way
on every resume, and journals data_skipped."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from trainwatch.errors import ConfigError
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.jsonl import read_jsonl
from trainwatch.trainer.data import ShardedBatches
from trainwatch.rank.skips import SkipSteps, read_skip_steps


def test_bad_skip_requests_name_the_file_and_key(tmp_path):
    run = RunDir(tmp_path / "run").create()
    assert 5 not in read_skip_steps(run)  # no request: nothing is skipped
    path = run.control_dir / "skip-steps.json"
    for text, key in (('{"from_step": 3}', "to_step"), ('{"from_step": -1, "to_step": 2}',
                                                        "from_step"),
                      ("[1, 2]", None), ('{"from_step": 3, "to_', None)):
        path.write_text(text)
        with pytest.raises(ConfigError) as info:
            read_skip_steps(run)
        assert info.value.file == str(path) and info.value.key == key


def test_drop_reads_exactly_the_window_s_batches():
    tokens = np.arange(4000, dtype=np.uint8)
    loader = ShardedBatches(tokens, context=8, batch_size=2, rank=0, world_size=1, seed=1)
    reference = ShardedBatches(tokens, context=8, batch_size=2, rank=0, world_size=1, seed=1)
    skip = SkipSteps(2, 3, "nan at step 3")
    assert [s for s in range(6) if s in skip] == [2, 3]
    for _ in range(2 * 2):  # steps 0-1, grad_accum 2
        next(loader), next(reference)
    assert skip.drop(2, loader, 2, final=False) is None
    summary = skip.drop(3, loader, 2, final=False)
    assert summary == {"steps": [2, 3], "batches_per_rank": 4, "reason": "nan at step 3",
                       "data_from": {"epoch": 0, "position": 4},
                       "data_to": {"epoch": 0, "position": 8}}
    for _ in range(4):
        next(reference)
    assert all((a == b).all() for a, b in zip(next(loader), next(reference)))


def _train(run_dir, steps=10):
    cmd = [sys.executable, "-m", "trainwatch.trainer", "--run-dir", str(run_dir),
           "--set", f"train.steps={steps}", "--set", "train.eval_interval=0",
           "--set", "checkpoint.every_steps=2", "--set", "checkpoint.keep_last=10",
           "--set", "checkpoint.fsync=false", "--set", "data.corpus_bytes=200000"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(run_dir)}
    env.pop("TRAINWATCH_FAULT", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_trainer_drops_the_window_and_a_resume_inside_it_continues_exactly(tmp_path):
    run = RunDir(tmp_path / "run").create()
    (run.control_dir / "skip-steps.json").write_text(
        json.dumps({"from_step": 3, "to_step": 5, "reason": "non-finite loss at step 5"}))
    _train(run.root)
    first = {r["step"]: r["loss"] for r in read_jsonl(run.metrics_file(0)).records
             if r.get("kind") == "step"}
    assert sorted(first) == [0, 1, 2, 6, 7, 8, 9]  # 3, 4, 5 never trained
    (skipped,) = run.events("data_skipped")
    assert skipped["steps"] == [3, 4, 5] and skipped["batches_per_rank"] == 3
    assert skipped["data_from"]["position"] == 3 and skipped["data_to"]["position"] == 6
    assert skipped["reason"] == "non-finite loss at step 5"
    # Resume from the checkpoint taken inside the window (4 steps done): steps 4 and 5 are
    # dropped again and the rest of the run is bit for bit the same.
    for step in (6, 8, 10):
        shutil.rmtree(run.checkpoint_dir / f"step-{step:08d}")
    _train(run.root)
    assert run.events("checkpoint_resumed")[-1]["step"] == 4
    assert run.events("data_skipped")[-1]["steps"] == [4, 5]
    again = [r for r in read_jsonl(run.metrics_file(0)).records if r.get("kind") == "step"]
    again = {r["step"]: r["loss"] for r in again[len(first):]}
    assert again == {s: first[s] for s in (6, 7, 8, 9)}
