"""The step's shape at another world size: the global batch stays, a rank's micro-batch
never grows past train.batch_size, and what cannot be split is refused (exit 2)."""

import pytest

from trainwatch.errors import EXIT_USAGE, ConfigError
from trainwatch.trainer.step_shape import StepShape, check_resumable, reshaped, saved_shape


def test_the_global_batch_stays_and_a_rank_never_takes_a_larger_micro_batch():
    two = StepShape(batch_size=8, grad_accum=1, world_size=2)
    assert reshaped(two, 2, 8) is two
    assert reshaped(two, 1, 8) == StepShape(8, 2, 1)  # a lost rank: accumulate instead
    assert reshaped(two, 4, 8) == StepShape(4, 1, 4)  # more ranks: smaller micro-batches
    assert reshaped(StepShape(8, 2, 1), 2, 8) == two  # and back again
    three = StepShape(8, 1, 3)  # 24 a step; 12 a rank at 2: micro-batches of 6, twice
    assert reshaped(three, 2, 8) == StepShape(6, 2, 2)
    assert reshaped(three, 1, 8) == StepShape(8, 3, 1)
    for world in (1, 2, 3, 4, 6, 8, 12, 24):
        assert reshaped(three, world, 8).global_batch == 24


def test_a_global_batch_the_new_world_size_cannot_split_is_refused_with_the_way_out():
    with pytest.raises(ConfigError) as info:
        reshaped(StepShape(8, 1, 4), 3, 8, file="/r/checkpoints/step-00000004")
    message = str(info.value)
    assert info.value.exit_code == EXIT_USAGE and "step-00000004" in message
    assert "global batch of 32 = 4 rank(s) x 1 micro-step(s) x batch 8 windows" in message
    assert "3 ranks cannot share 32 evenly" in message
    assert "run with a world size that divides 32 (1, 2, 4, 8, 16, 32)" in message


def test_the_launcher_reads_the_shape_from_the_manifests_data_position():
    """Rank 0's data position, as the manifest records it; one written before the shape
    was recorded has no grad_accum (the config's, part of the weights' digest)."""
    position = {"epoch": 0, "position": 4, "seed": 0, "world_size": 2, "batch_size": 8}
    manifest = {"layout": "dcp", "world_size": 2, "data_position": [position, position]}
    assert check_resumable(manifest, 1, 8, 1) == StepShape(8, 2, 1)
    assert check_resumable(manifest, 1, 8, 3) == StepShape(8, 6, 1)
    now = {**position, "grad_accum": 2, "world_size": 1}
    assert check_resumable({"data_position": [now]}, 2, 8, 1) == StepShape(8, 1, 2)
    with pytest.raises(ConfigError, match="3 ranks cannot share 16"):
        check_resumable(manifest, 3, 8, 1)
    # not the reference trainer's position (a user's loop): nothing to check
    assert check_resumable({"data_position": [{"offset": 3}]}, 3, 8, 1) is None
    assert check_resumable({"data_position": None}, 3, 8, 1) is None
    assert saved_shape({**position, "batch_size": True}, 1) is None
