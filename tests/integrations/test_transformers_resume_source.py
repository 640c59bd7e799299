"""A Hugging Face script that calls ``cb.resume_path()`` but gives ``trainer.train``
another checkpoint (or none): the journal said ``checkpoint_resumed`` from trainwatch's
newest anyway, so report and the restart guard counted a resume that never happened. Now
only the start the Trainer made is journaled, and the rank warns, naming both."""

import logging
import os

import pytest

from framework_helpers import hf_train
from trainwatch.rundir.run_dir import RunDir


def test_a_start_from_another_checkpoint_is_said_and_not_journaled_as_ours(tmp_path, caplog):
    pytest.importorskip("transformers")
    from trainwatch.integrations.transformers import TrainwatchCallback

    run = RunDir(tmp_path / "run")
    output = os.path.join(run.root, "hf")
    hf_train(TrainwatchCallback(run.root), output, 6, save_steps=3)  # checkpoint-3, -6
    cb = TrainwatchCallback(run.root)
    assert cb.resume_path(output).endswith("checkpoint-6")
    with caplog.at_level(logging.WARNING, logger="trainwatch.integrations.transformers"):
        hf_train(cb, output, 8, resume=os.path.join(output, "checkpoint-3"))
    assert run.events("checkpoint_resumed") == []
    assert "started at step 3" in caplog.text and "checkpoint-6" in caplog.text

    cb = TrainwatchCallback(run.root)
    hf_train(cb, output, 8, resume=cb.resume_path(output))  # as the docs say: checkpoint-6
    [resumed] = run.events("checkpoint_resumed")
    assert resumed["step"] == 6 and resumed["path"].endswith("checkpoint-6")
