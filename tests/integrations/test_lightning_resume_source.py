"""A Lightning script that keeps its own resume (``ckpt_path="last"`` or a path of its
ModelCheckpoint) next to trainwatch's callback: a restart then continued from that older
file while trainwatch's newer checkpoint was ignored, and the journal still said
``checkpoint_resumed`` from trainwatch's when ``resume_path()`` had been called. Now the
journal records only the resume that happened, and the rank warns, naming both files."""

import logging

import pytest

from framework_helpers import fit
from trainwatch.rundir.run_dir import RunDir


def test_resuming_from_another_file_is_said_and_not_journaled_as_ours(tmp_path, caplog):
    L = pytest.importorskip("lightning")
    import torch

    from trainwatch.integrations.lightning import TrainwatchCallback

    run = RunDir(tmp_path / "run")
    first = fit(L, torch, TrainwatchCallback(run.root, every_steps=5), 5)
    mine = tmp_path / "mine.ckpt"  # the script's own save, at step 5
    first.save_checkpoint(str(mine))
    cb = TrainwatchCallback(run.root, every_steps=5)
    fit(L, torch, cb, 10, ckpt_path=cb.resume_path())  # trainwatch's step 10
    cb = TrainwatchCallback(run.root, every_steps=5)
    assert cb.resume_path()  # trainwatch's step 10 (through memory snapshots' staged path)
    with caplog.at_level(logging.WARNING, logger="trainwatch.integrations.lightning"):
        fit(L, torch, cb, 12, ckpt_path=str(mine))
    told = [r.getMessage() for r in caplog.records if "resume" in r.getMessage()]
    assert told and str(mine) in told[0] and "step-00000010" in told[0], told
    resumed = [e["path"] for e in run.events("checkpoint_resumed")]
    assert resumed == [str(run.checkpoint_dir / "step-00000005")], resumed  # the 2nd fit's


def test_resuming_from_ours_is_journaled_and_quiet(tmp_path, caplog):
    L = pytest.importorskip("lightning")
    import torch

    from trainwatch.integrations.lightning import TrainwatchCallback

    run = RunDir(tmp_path / "run")
    fit(L, torch, TrainwatchCallback(run.root, every_steps=5), 10)
    cb = TrainwatchCallback(run.root, every_steps=5)
    with caplog.at_level(logging.WARNING, logger="trainwatch.integrations.lightning"):
        fit(L, torch, cb, 12, ckpt_path=cb.resume_path())
    assert not [r for r in caplog.records if "resume" in r.getMessage()]
    assert [e["step"] for e in run.events("checkpoint_resumed")] == [10]
