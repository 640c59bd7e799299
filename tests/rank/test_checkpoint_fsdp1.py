"""FSDP1 (FullyShardedDataParallel) state is saved through DCP like FSDP2's.

Before: ``Checkpoints`` refused an FSDP1 model and an optimizer over its FlatParameters as
bad input (exit 2, "shard with FSDP2"). Now the model's sharded state dict
(ShardedTensors, from ``get_model_state_dict``) and its optimizer's are written by every
rank through DCP, async saves included (DCP's stagers cannot copy a ShardedTensor:
fsdp1_staging.py does), with a manifest recording where each chunk sits, and resumed
exactly: into FSDP1 again, or into the same model unwrapped (keyed by parameter name, so
another world size can load it). Memory snapshots, which hold DTensor shards only, are
turned off with the reason. One-rank gloo group (FSDP1 does not shard at world size 1: the
ShardedTensors of an async save are made by hand here); the 2-rank jobs (a SIGKILLed rank,
2 -> 1) are in test_checkpoint_sharded_e2e.py."""

import copy

import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel

from trainwatch import Checkpoints
from trainwatch.rank.checkpoint.checkpointer import Checkpointer
from trainwatch.rank.checkpoint.config import CheckpointConfig
from trainwatch.checkpoint_format.catalog import complete
from trainwatch.errors import ConfigError
from trainwatch.rank.checkpoint import whole_state
from trainwatch.rundir.run_dir import RunDir


def _plain(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _fsdp1(seed=0):
    model = FullyShardedDataParallel(_plain(seed), device_id=torch.device("cpu"))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _full(model):
    with FullyShardedDataParallel.summon_full_params(model):
        return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def test_an_fsdp1_model_and_optimizer_are_sharded_state_not_bad_input(group):
    model, opt = _fsdp1()
    assert whole_state.check_objects({"model": model, "optimizer": opt}) is True
    assert whole_state.check_objects({"optimizer": opt}) is True  # its FlatParameters
    flat = opt.param_groups[0]["params"][0]  # outside its model: still not saveable
    with pytest.raises(ConfigError, match=r"params\[0\]: FlatParameter .*pass the sharded model and its optimizer"):
        whole_state.check_trees({"params": [flat]})


def test_fsdp1_saves_async_through_dcp_and_resumes_exactly(group, tmp_path):
    run = RunDir(tmp_path / "run")
    model, opt = _fsdp1()
    ckpt = Checkpoints.from_env(run.root, every_steps=2, mode="async", fsync=False)
    assert ckpt.resume(model=model, optimizer=opt) == 0
    for step in (1, 2):
        _train(model, opt)
        ckpt.maybe_save(step, model=model, optimizer=opt)
    weights, moments = _full(model), copy.deepcopy(opt.state_dict()["state"])
    _train(model, opt)  # the loop goes on while step 2 is written: its copy is kept apart
    ckpt.close(final=False)
    assert not run.events("checkpoint_failed"), run.events("checkpoint_failed")
    (off,) = run.events("memory_snapshots_off")
    assert off["reason"].startswith("FSDP1 (FullyShardedDataParallel) state: memory snapshots")
    (entry,) = complete(run.checkpoint_dir)
    assert (entry.step, entry.manifest["layout"]) == (2, "dcp")
    assert {"__0_0.distcp", ".metadata"} <= set(entry.manifest["files"])

    again, opt2 = _fsdp1(seed=1)
    ckpt = Checkpoints.from_env(run.root, mode="sync", fsync=False)
    assert ckpt.resume(model=again, optimizer=opt2) == 2
    ckpt.close(final=False)
    assert all(torch.equal(v, weights[k]) for k, v in _full(again).items())
    loaded = opt2.state_dict()["state"]
    assert all(torch.equal(loaded[i][name], value) for i, state in moments.items()
               for name, value in state.items())

    plain = _plain(seed=2)  # the same model, not wrapped: keyed by parameter name
    ckpt = Checkpoints.from_env(run.root, mode="sync", fsync=False, memory_snapshots="off")
    assert ckpt.resume(model=plain) == 2
    ckpt.close(final=False)
    assert all(torch.equal(v, weights[k]) for k, v in plain.state_dict().items())


def test_an_async_save_copies_sharded_tensors_itself_and_records_their_chunks(group,
                                                                             tmp_path):
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    weight = torch.arange(16.0).reshape(4, 4)
    tensor = init_from_local_shards([Shard.from_tensor_and_offsets(weight.clone(), [0, 0], 0)],
                                    4, 4)
    run = RunDir(tmp_path / "run")
    ckpt = Checkpointer(CheckpointConfig(every_steps=1, mode="async", fsync=False,
                                         memory_snapshots="off"), run.root).start()
    ckpt.after_step(1, lambda: {"model": {"w": tensor}})
    tensor.local_shards()[0].tensor.add_(100)  # the loop goes on: the save has its own copy
    ckpt.close()
    assert not run.events("checkpoint_failed"), run.events("checkpoint_failed")
    (entry,) = complete(run.checkpoint_dir)
    assert entry.manifest["dcp"]["placements"] == {"model.w": ["[0:4, 0:4] on rank 0"]}
    loaded = {"model": {"w": torch.zeros(4, 4)}}
    import torch.distributed.checkpoint as dcp
    dcp.load(loaded, checkpoint_id=str(entry.path))
    assert torch.equal(loaded["model"]["w"], weight)
