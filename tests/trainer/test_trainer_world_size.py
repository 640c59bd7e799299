"""The reference trainer continues a data-parallel job at another world size as the job
would have gone on: the same global batch a step (a rank's micro-batches accumulated
instead), from the windows the job had consumed. In this process: two replicas stand for
a 2-rank DDP job (gradients averaged as DDP does); the real FSDP2 2 -> 1 rank run is
tests/trainer/test_trainer_fsdp_e2e.py."""

import copy
from pathlib import Path

import pytest
import torch

from trainwatch.errors import ConfigError
from trainwatch.rank.checkpoint import Restored
from trainwatch.trainer.config import load_config
from trainwatch.trainer.data import load_dataset, prepare_generated
from trainwatch.trainer.step_shape import StepShape
from trainwatch.trainer.train import Ranks, build_training_state, checkpoint_state, \
    restore_checkpoint
from trainer_helpers import data_parallel_steps

SETS = ["model.context=32", "train.batch_size=4", "train.steps=12", "optim.warmup_steps=2"]



def _ranks(rank, world_size):
    return Ranks(rank, rank, world_size, torch.device("cpu"), False, 0)


def _restored(state, path):
    """What the checkpointer hands a rank of another world size: rank 0's trees and its
    data position (resume.py)."""
    saved = copy.deepcopy(checkpoint_state(state))
    data = saved.pop("data")
    return Restored(Path(path), state.step, {}, saved, {"data": data})


@torch.no_grad()
def _distance(a, b):
    return float(sum((x - y).pow(2).sum() for x, y in zip(a, b)).sqrt())


def test_a_2_rank_checkpoint_continues_at_1_rank_as_the_2_rank_job_goes_on(tmp_path, one_thread):
    prepare_generated(tmp_path / "d", size_bytes=15_000, seed=3, val_fraction=0.1)
    data = load_dataset(tmp_path / "d")
    cfg = load_config(None, SETS)
    pair = [build_training_state(cfg, data, _ranks(r, 2)) for r in range(2)]
    start = [p.detach().clone() for p in pair[0].model.parameters()]
    data_parallel_steps(pair, 4)
    restored = _restored(pair[0], tmp_path / "step-00000004")
    at_save = [p.detach().clone() for p in pair[0].model.parameters()]
    expected = data_parallel_steps(pair, 4)

    alone = build_training_state(cfg, data, _ranks(0, 1))
    restore_checkpoint(alone, restored)
    assert alone.step == 4 and alone.shape == StepShape(4, 2, 1)  # 8 windows a step, as before
    assert alone.loader.state_dict()["consumed"] == 4 * 8
    got = data_parallel_steps([alone], 4)
    # The same windows, summed in another order: equal to float rounding. A step's data
    # repeated or skipped would change the loss at the first percent.
    assert got == pytest.approx(expected, rel=1e-5)
    assert _distance(pair[0].model.parameters(), alone.model.parameters()) < 1e-3 * _distance(
        pair[0].model.parameters(), at_save)
    assert any(not torch.equal(a, b) for a, b in zip(start, at_save))
    assert checkpoint_state(alone)["data"]["grad_accum"] == 2  # and back at 2: batch 4 again


def test_a_global_batch_the_new_world_size_cannot_split_is_refused_before_loading(tmp_path):
    prepare_generated(tmp_path / "d", size_bytes=15_000, seed=3, val_fraction=0.1)
    data = load_dataset(tmp_path / "d")
    cfg = load_config(None, [*SETS, "train.batch_size=3"])
    pair = build_training_state(cfg, data, _ranks(0, 2))
    restored = _restored(pair, tmp_path / "step-00000000")
    restored.shared = {}  # nothing is loaded before the shape is checked
    with pytest.raises(ConfigError, match="4 ranks cannot share 6 evenly") as info:
        restore_checkpoint(build_training_state(cfg, data, _ranks(0, 4)), restored)
    assert info.value.file == str(tmp_path / "step-00000000")
