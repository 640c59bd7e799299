"""The Hugging Face callback records each optimizer step's samples (all its micro-batches),
so samples/s and TrainingThroughputDrop work for a Trainer job; it recorded none, and the
throughput alert could never fire for one."""

import os

import pytest

from framework_helpers import hf_train
from trainwatch.rundir.run_dir import RunDir

BATCH, ACCUMULATE, STEPS = 4, 3, 5


def test_each_step_records_the_samples_of_all_its_micro_batches(tmp_path):
    pytest.importorskip("transformers")

    from trainwatch.integrations.transformers import TrainwatchCallback

    run = RunDir(tmp_path / "run")
    hf_train(TrainwatchCallback(run.root), os.path.join(run.root, "hf"), STEPS,
             accumulate=ACCUMULATE, batch=BATCH)
    steps = [r for r in run.metrics(0).records if r.get("kind") == "step"]
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert [r.get("samples") for r in steps] == [BATCH * ACCUMULATE] * STEPS
    assert all(r.get("samples_per_second") for r in steps)
