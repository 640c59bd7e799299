"""The framework callbacks' defaults are safe: Lightning's saves on the checkpoint
library's schedule unless told otherwise, and says so when told not to."""

import logging

import pytest

from trainwatch.rank.checkpoint.config import CheckpointConfig


def test_lightning_callback_checkpoints_by_default_and_warns_at_0(tmp_path, caplog):
    pytest.importorskip("lightning")
    from trainwatch.integrations.lightning import TrainwatchCallback

    with caplog.at_level(logging.WARNING, logger="trainwatch.integrations.lightning"):
        default = TrainwatchCallback(tmp_path / "run")
        assert not caplog.records
        assert default.every_steps == CheckpointConfig().every_steps > 0
        TrainwatchCallback(tmp_path / "run", every_steps=0)
    assert [r.getMessage() for r in caplog.records if "every_steps=0" in r.getMessage()]
