"""TrainingState captures everything needed for a bit-exact continuation (what checkpoints save)."""

import copy

import torch

from trainwatch.trainer.config import load_config
from trainwatch.trainer.data import load_dataset, prepare_generated
from trainwatch.trainer.train import Ranks, build_training_state, lr_factor
from trainer_helpers import run_steps



def test_restored_state_continues_bit_for_bit(tmp_path, one_thread):
    prepare_generated(tmp_path / "d", size_bytes=15_000, seed=3, val_fraction=0.1)
    data = load_dataset(tmp_path / "d")
    # Dropout makes the continuation depend on the RNG state too; a small epoch makes it
    # cross an epoch boundary after the save.
    cfg = load_config(None, ["model.dropout=0.2", "model.context=32", "train.batch_size=16",
                             "train.steps=40", "optim.warmup_steps=5"])
    ranks = Ranks(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"),
                  distributed=False, restart_count=0)
    original = build_training_state(cfg, data, ranks)
    run_steps(original, 20)
    saved = copy.deepcopy(original.state_dict())
    expected = run_steps(original, 10)
    assert original.loader.epoch >= 1

    restored = build_training_state(cfg, data, ranks)
    torch.manual_seed(999)  # disturb the RNG: the restore must bring it back
    restored.load_state_dict(saved)
    assert restored.step == 20
    assert run_steps(restored, 10) == expected
    for a, b in zip(original.model.parameters(), restored.model.parameters()):
        assert torch.equal(a, b)
    assert restored.scheduler.get_last_lr() == original.scheduler.get_last_lr()


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = load_config(None, ["train.steps=100", "optim.warmup_steps=10",
                             "optim.min_lr_ratio=0.1"])
    factors = [lr_factor(cfg, s) for s in range(100)]
    assert factors[0] == 0.1 and factors[9] == 1.0
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))
    assert abs(factors[-1] - 0.1) < 1e-9
    flat = load_config(None, ["optim.cosine=false", "optim.warmup_steps=0"])
    assert {lr_factor(flat, s) for s in range(0, 200, 7)} == {1.0}
