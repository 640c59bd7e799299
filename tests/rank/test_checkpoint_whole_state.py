"""State a checkpoint cannot hold whole is bad input, refused before any file is written;
sharded (DTensor) state is told apart and saved through DCP.

Before: a DTensor (FSDP2) model's async saves all failed (".numpy() is not supported for
tensor subclasses"), a sync save sealed rank 0's shards only, and a resume loaded them as
the whole model. Then such state was refused; now it is seen at the first look and saved
by every rank through DCP (test_checkpoint_sharded.py; FSDP1's too:
test_checkpoint_fsdp1.py), while other tensor subclasses, meta tensors and objects that
do not pickle still raise a ConfigError naming the key, the type and the fix (the
rank's bad-input path: exit 2, not restarted); plain,
DDP and Python state save as before. One-rank gloo group, 1-device CPU mesh."""

import threading

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.testing._internal.two_tensor import TwoTensor

from trainwatch import Checkpoints
from trainwatch.checkpoint_format.catalog import complete
from trainwatch.errors import ConfigError
from trainwatch.rank.checkpoint import whole_state
from trainwatch.rank.checkpoint.checkpointer import Checkpointer
from trainwatch.rank.checkpoint.config import CheckpointConfig
from trainwatch.rundir.run_dir import RunDir

DTENSOR = "DTensor (sharded over mesh ('dp',) with Shard(0))"


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _fsdp2():
    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    return model, opt


def _nothing_written(run):
    folder = RunDir(run).checkpoint_dir
    return not folder.exists() or not any(folder.iterdir())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_fsdp2_model_is_seen_as_sharded_and_saved_through_dcp_not_refused(
        group, tmp_path, mode):
    model, opt = _fsdp2()
    assert whole_state.check_objects({"model": model, "optimizer": opt}) is True
    assert whole_state.check_objects({"model": _model()}) is False
    run = tmp_path / "run"
    ckpt = Checkpoints.from_env(run, every_steps=1, mode=mode, fsync=False)
    assert ckpt.resume(model=model, optimizer=opt) == 0
    assert ckpt.maybe_save(1, model=model, optimizer=opt)
    ckpt.close(final=False)
    (entry,) = complete(RunDir(run).checkpoint_dir)
    assert entry.manifest["layout"] == "dcp" and "__0_0.distcp" in entry.manifest["files"]
    assert not RunDir(run).events("checkpoint_failed")


def test_the_checkpointer_saves_sharded_trees_from_the_reference_trainers_side(group,
                                                                             tmp_path):
    model, opt = _fsdp2()
    ckpt = Checkpointer(CheckpointConfig(every_steps=1, mode="sync", fsync=False),
                        tmp_path / "run").start()
    ckpt.after_step(1, lambda: {"model": model.state_dict(), "optimizer": opt.state_dict()})
    ckpt.close()
    (entry,) = complete(RunDir(tmp_path / "run").checkpoint_dir)
    assert entry.manifest["layout"] == "dcp"
    assert entry.manifest["dcp"]["placements"]["model.0.weight"] == ["Shard(0)"]


def test_a_sharded_optimizer_alone_is_seen_as_sharded(group):
    _, opt = _fsdp2()
    assert whole_state.check_objects({"optimizer": opt}) is True
    assert whole_state.describe_tensor(opt.param_groups[0]["params"][0]) == DTENSOR


def test_tensor_subclasses_are_named(group):
    with pytest.raises(ConfigError, match=r"extra\.t: tensor subclass .*TwoTensor"):
        whole_state.check_trees({"extra": {"t": TwoTensor(torch.ones(2), torch.ones(2))}})
    with pytest.raises(ConfigError, match=r"w: meta tensor"):
        whole_state.check_trees({"w": torch.empty(2, device="meta")})


class Cursor:
    """A user's object without state_dict that does not pickle."""

    def __init__(self):
        self.lock = threading.Lock()


def test_state_that_does_not_pickle_is_refused_naming_its_key(tmp_path):
    model = _model()
    ckpt = Checkpoints.from_env(tmp_path / "a", every_steps=1, mode="sync", fsync=False)
    with pytest.raises(ConfigError, match=r"cannot checkpoint extra\.lock: _thread\.lock "
                                          r"cannot be pickled"):
        ckpt.maybe_save(1, model=model, extra={"lock": threading.Lock()})
    ckpt.close(final=False)
    ckpt = Checkpoints.from_env(tmp_path / "b", every_steps=1, mode="sync", fsync=False)
    with pytest.raises(ConfigError, match=r"cannot checkpoint cursor: .*\.Cursor cannot be "
                                          r"pickled .*or an object with state_dict\(\)"):
        ckpt.maybe_save(1, model=model, cursor=Cursor())
    ckpt.close(final=False)
    assert _nothing_written(tmp_path / "a") and _nothing_written(tmp_path / "b")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ddp_and_plain_state_save_and_resume_as_before_looked_at_once(group, tmp_path,
                                                                     monkeypatch, mode):
    calls = []
    check = whole_state.check_trees
    monkeypatch.setattr(whole_state, "check_trees", lambda s: (calls.append(1), check(s)))
    model = DistributedDataParallel(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    extra = {"epoch": 1, "p": torch.nn.Parameter(torch.ones(2)), "dtype": torch.float16,
             "shape": torch.Size([2, 3]), "names": ("a", None)}
    run = tmp_path / "run"
    ckpt = Checkpoints.from_env(run, every_steps=1, mode=mode, fsync=False)
    assert ckpt.resume(model=model, optimizer=opt, extra=extra) == 0
    for step in range(3):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ckpt.maybe_save(step + 1, model=model, optimizer=opt, extra=extra)
    ckpt.close()
    assert [e.step for e in complete(RunDir(run).checkpoint_dir)][0] == 3
    assert calls == [1], "the state is looked at once per Checkpointer, not every save"
    assert not RunDir(run).events("checkpoint_failed")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_tensors_pass():
    whole_state.check_trees({"model": _model().cuda().state_dict()})
    whole_state.check_objects({"model": _model().cuda()})
