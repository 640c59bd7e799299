"""The reference trainer's memory snapshots read the live tensors (memory_snapshots/live.py)
instead of calling ``state_dict()`` every step, and each one is still exactly its step's
``checkpoint_state``: model, optimizer, schedule and data position."""

import torch

from state_trees import assert_same_tree
from trainer_helpers import run_steps
from trainwatch.rank.checkpoint import Checkpointer
from trainwatch.rank.memory_snapshots import store
from trainwatch.rank.memory_snapshots.resume import load_file
from trainwatch.trainer.config import load_config
from trainwatch.trainer.data import load_dataset, prepare_generated
from trainwatch.trainer.train import (Ranks, build_training_state, checkpoint_state,
                                      data_position, snapshot_live)


def test_every_snapshot_is_its_steps_checkpoint_state_read_the_live_way(tmp_path, one_thread):
    prepare_generated(tmp_path / "d", size_bytes=15_000, seed=3, val_fraction=0.1)
    (tmp_path / "shm").mkdir()
    (tmp_path / "run").mkdir()  # a run directory that exists: the sweep keeps its snapshots
    cfg = load_config(None, ["model.context=32", "train.batch_size=8", "train.steps=40",
                             "optim.warmup_steps=5", "checkpoint.every_steps=0",
                             "checkpoint.fsync=false", "checkpoint.memory_snapshots=every_step",
                             f"checkpoint.memory_snapshots_dir={tmp_path / 'shm'}"])
    ranks = Ranks(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"),
                  distributed=False, restart_count=0)
    state = build_training_state(cfg, load_dataset(tmp_path / "d"), ranks)
    ckpt = Checkpointer(cfg.checkpoint, tmp_path / "run")
    memory = ckpt.memory
    live = snapshot_live(state)
    assert live is not None
    fast = []
    for step in range(1, 13):
        run_steps(state, 1)
        before = memory._live.fast_total
        ckpt.after_step(step, lambda: checkpoint_state(state),
                        data=lambda: data_position(state), snapshot_live=live)
        memory.wait()
        fast.append(memory._live.fast_total > before)
        newest = store.sealed(memory.folder)[0]
        assert newest.step == step
        restored, problem = load_file(newest.path, step, 1)
        assert problem is None, problem
        expected = checkpoint_state(state)
        assert_same_tree(restored.shared, {k: v for k, v in expected.items() if k != "data"},
                         f"step {step}")
        assert restored.data == expected["data"], step
    ckpt.close()
    # the first steps learn the layout (AdamW's state comes at its first step); then the plan
    assert all(fast[3:]), fast
