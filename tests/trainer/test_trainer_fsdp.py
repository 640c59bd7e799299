"""The reference trainer's ``parallel.mode: fsdp``: the model sharded by FSDP2, its
checkpoints DCP ones that resume exactly, and a checkpoint of the other mode refused.

In one process (a world-size-1 gloo group): every parameter a DTensor, AdamW over the
shards, a save through the trainer's own ``checkpoint_state`` that is ``layout: dcp``,
a resume into freshly built state equal to the saved state and training on identically,
and a ddp-mode run that refuses the checkpoint (exit 2) before loading it.
The two-rank run with a SIGKILLed rank is tests/trainer/test_trainer_fsdp_e2e.py."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.tensor import DTensor

from trainwatch.checkpoint_format.compat import check_compatible
from trainwatch.trainer.step_shape import StepShape, check_resumable
from trainwatch.checkpoint_format.manifest import read_manifest
from trainwatch.errors import ConfigError
from trainwatch.rank.checkpoint import Checkpointer
from trainwatch.rank.replicas import tensors_of
from trainwatch.rundir.run_dir import RunDir
from trainwatch.trainer import parallel
from trainwatch.trainer.config import ParallelConfig, check_world_size, load_config
from trainwatch.trainer.data import load_dataset, prepare_generated
from trainwatch.trainer.train import (Ranks, build_training_state, checkpoint_state,
                                      restore_checkpoint)
from trainer_helpers import run_steps


@pytest.fixture
def group():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit-exact comparisons, and no spinning on a busy box
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    torch.set_num_threads(threads)


def _full(state):
    model, optim = get_state_dict(state.model, state.optimizer,
                                  options=StateDictOptions(full_state_dict=True))
    return model, optim


@pytest.mark.parametrize("mode", [["parallel.mode=fsdp"],
                                  ["parallel.mode=hsdp", "parallel.shard_size=1"]])
def test_sharded_modes_save_dcp_resume_exactly_and_ddp_mode_refuses_it(group, tmp_path, mode):
    prepare_generated(tmp_path / "d", size_bytes=15_000, seed=3, val_fraction=0.1)
    data = load_dataset(tmp_path / "d")
    cfg = load_config(None, [*mode, "model.layers=1", "model.width=32",
                             "model.context=16", "train.batch_size=2", "checkpoint.mode=sync",
                             "checkpoint.fsync=false"])
    ranks = Ranks(0, 0, 1, torch.device("cpu"), True, 0)
    state = build_training_state(cfg, data, ranks)
    assert all(isinstance(p, DTensor) for p in state.model.parameters())
    # the replica digest reads this rank's shards, never the DTensors (no collectives)
    assert not any(isinstance(t, DTensor) for t in tensors_of(state.model, state.optimizer))
    run_steps(state, 2)

    run = RunDir(tmp_path / "run").create()
    ckpt = Checkpointer(cfg.checkpoint, run.root, config_hash=cfg.training_digest(),
                        sharded=True).start()
    ckpt.after_step(state.step, lambda: checkpoint_state(state), final=True)
    ckpt.close()
    assert ckpt.facts["ok"], ckpt.facts["last_error"]
    manifest = read_manifest(run.checkpoint_dir / "step-00000002")
    assert manifest["layout"] == "dcp" and manifest["world_size"] == 1
    assert manifest["dcp"]["mesh"]["shape"] == ([1] if "fsdp" in mode[0] else [1, 1])
    assert sorted(manifest["shared"]) == ["model", "optimizer", "scheduler"]

    fresh = build_training_state(cfg, data, ranks)
    loader = Checkpointer(cfg.checkpoint, run.root, config_hash=cfg.training_digest(),
                          sharded=True)
    restored = loader.resume()
    assert restored is not None and restored.step == 2
    restore_checkpoint(fresh, restored, loader.group)
    restored.restore_rng()
    saved_model, saved_optim = _full(state)
    model, optim = _full(fresh)
    assert model.keys() == saved_model.keys()
    assert all(torch.equal(model[k], saved_model[k]) for k in model)
    assert fresh.scheduler.state_dict() == state.scheduler.state_dict()
    assert fresh.loader.state_dict() == state.loader.state_dict()
    for fqn, values in saved_optim["state"].items():
        assert all(torch.equal(optim["state"][fqn][k], v) for k, v in values.items())
    assert run_steps(fresh, 2) == run_steps(state, 2)  # and it trains on the same

    with pytest.raises(ConfigError, match=r"written by a sharded run .*, this run is "
                                          r"data-parallel .*set parallel.mode: fsdp"):
        Checkpointer(cfg.checkpoint, run.root, config_hash=cfg.training_digest(),
                     sharded=False).resume()


def test_fsdp_mode_without_a_process_group_is_bad_input(tmp_path):
    prepare_generated(tmp_path / "d", size_bytes=15_000, seed=3, val_fraction=0.1)
    cfg = load_config(None, ["parallel.mode=fsdp", "model.layers=1", "model.width=32"])
    with pytest.raises(ConfigError, match="needs a process group: run it under torchrun"):
        build_training_state(cfg, load_dataset(tmp_path / "d"),
                             Ranks(0, 0, 1, torch.device("cpu"), False, 0))


def test_each_mode_compares_the_replicas_it_has_and_says_what_it_turned_off():
    ddp, fsdp = ParallelConfig(), ParallelConfig(mode="fsdp")
    hsdp = ParallelConfig(mode="hsdp", shard_size=4)
    # replica groups: every rank (DDP); none (FSDP: one copy of each shard); HSDP: the
    # ranks holding the same shard, r % shard_size, on a (replicas, shard_size) mesh
    assert [parallel.replica_group(ddp, r) for r in range(3)] == [0, 0, 0]
    assert parallel.replica_group(fsdp, 5) is None
    assert [parallel.replica_group(hsdp, r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert parallel.sdc_note(ddp, 50, 50) is None
    assert "replica digests and the reduction checksum are off" in parallel.sdc_note(fsdp, 50, 0)
    assert parallel.sdc_note(fsdp, 0, 0) is None  # nothing asked for, nothing to say
    note = parallel.sdc_note(hsdp, 50, 50)
    assert "reduction checksum is off" in note and "r % 4" in note and "\n" not in note
    assert parallel.sdc_note(hsdp, 50, 0) is None
    check_world_size(hsdp, 8)
    with pytest.raises(ConfigError, match="4 does not divide the world size 6") as info:
        check_world_size(hsdp, 6)
    assert info.value.key == "parallel.shard_size"


def test_the_trainer_resumes_a_sharded_checkpoint_at_another_world_size(tmp_path):
    """DCP reshards the model and the trainer's data position is the job's: any world size
    that splits the global batch resumes (trainer/step_shape.py, the launcher asks too)."""
    position = {"epoch": 0, "position": 3, "seed": 0, "world_size": 4, "batch_size": 8}
    manifest = {"layout": "dcp", "world_size": 4, "data_position": [position] * 4}
    check_compatible(manifest, tmp_path, config_hash=None, sharded=True)
    assert check_resumable(manifest, 2, 8, 1) == StepShape(8, 2, 2)
    with pytest.raises(ConfigError, match="3 ranks cannot share 32 evenly"):
        check_resumable(manifest, 3, 8, 1)


def test_a_sharded_run_resumes_its_own_shards_from_a_memory_snapshot_exactly(group, tmp_path):
    """Before: parallel.mode fsdp/hsdp took no memory snapshots (restarts went back to the
    DCP checkpoint). Now each rank's shards are snapshotted and the trainer's own resume
    (Checkpointer.resume with the model's DTensors, restore_checkpoint) puts them back."""
    prepare_generated(tmp_path / "d", size_bytes=15_000, seed=3, val_fraction=0.1)
    data = load_dataset(tmp_path / "d")
    (tmp_path / "shm").mkdir()
    cfg = load_config(None, ["parallel.mode=hsdp", "parallel.shard_size=1", "model.layers=1",
                             "model.width=32", "model.context=16", "train.batch_size=2",
                             "checkpoint.every_steps=10", "checkpoint.fsync=false",
                             "checkpoint.memory_snapshots=every_step",
                             f"checkpoint.memory_snapshots_dir={tmp_path / 'shm'}"])
    ranks = Ranks(0, 0, 1, torch.device("cpu"), True, 0)
    state = build_training_state(cfg, data, ranks)
    run = RunDir(tmp_path / "run").create()
    ckpt = Checkpointer(cfg.checkpoint, run.root, config_hash=cfg.training_digest(),
                        sharded=True).start()
    for _ in range(3):
        run_steps(state, 1)
        ckpt.after_step(state.step, lambda: checkpoint_state(state))
    ckpt.memory.wait()  # and the process died: no close, its snapshots left in the tmpfs
    assert ckpt.memory.facts["step"] == 3 and ckpt.memory.facts["off_reason"] is None

    fresh = build_training_state(cfg, data, ranks)
    loader = Checkpointer(cfg.checkpoint, run.root, config_hash=cfg.training_digest(),
                          sharded=True)
    restored = loader.resume(parallel.live_trees(fresh.model, fresh.mode))
    assert restored is not None and restored.step == 3
    assert restored.manifest["source"] == "memory snapshot" and restored.manifest["sharded"]
    restore_checkpoint(fresh, restored, loader.group)
    restored.restore_rng()
    (saved_model, saved_optim), (model, optim) = _full(state), _full(fresh)
    assert all(torch.equal(model[k], saved_model[k]) for k in saved_model)
    for fqn, values in saved_optim["state"].items():
        assert all(torch.equal(optim["state"][fqn][k], v) for k, v in values.items())
    assert fresh.scheduler.state_dict() == state.scheduler.state_dict()
    assert fresh.loader.state_dict() == state.loader.state_dict() and fresh.step == 3
    assert run_steps(fresh, 2) == run_steps(state, 2)  # and it trains on the same
    assert all(isinstance(p, DTensor) for p in fresh.model.parameters())
