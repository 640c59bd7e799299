"""Memory snapshots of sharded (FSDP2, DTensor) state: each rank's own shards, and back.

Before: a job whose state held DTensors took no memory snapshots (``memory_snapshots_off``,
"sharded (DTensor) state is not snapshotted yet") and every restart went back to the
durable DCP checkpoint. Now each rank snapshots its DTensors' local shards with their
mesh, placements and shapes (trainwatch/rank/memory_snapshots/shards.py) and a resume at
the same world size and mesh loads them back exactly (model and optimizer); another mesh,
other placements, another world size or a corrupt file fall back with a named reason.
One-rank gloo group and CPU meshes; the 2-rank torchrun job is in
test_checkpoint_sharded_e2e.py."""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

from trainwatch.rank.checkpoint import Checkpoints, sharded
from trainwatch.rank.memory_snapshots import shards, store
from trainwatch.rank.memory_snapshots.snapshotter import MemorySnapshots
from trainwatch.rundir.run_dir import RunDir


def _model(mesh_shape=(1,), names=("dp",), placement=None, sharded=True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    if sharded:
        fully_shard(model, mesh=init_device_mesh("cpu", mesh_shape, mesh_dim_names=names),
                    shard_placement_fn=placement)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _loop(run, shm, steps, crash=True, **model):
    """Train to ``steps`` (durable checkpoint every 10); ``crash``: no close (the process
    died with its snapshots in the tmpfs)."""
    net, opt = _model(**model)
    ckpt = Checkpoints.from_env(run, every_steps=10, fsync=False, mode="sync",
                                memory_snapshots="every_step", memory_snapshots_dir=str(shm))
    start = ckpt.resume(model=net, optimizer=opt)
    for step in range(start, steps):
        net(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ckpt.maybe_save(step + 1, model=net, optimizer=opt)
    ckpt.checkpointer.memory.wait()
    if not crash:
        ckpt.close()
    return ckpt, start, net, opt


def _local(net, opt):
    """This rank's shards of the model and the optimizer state, as plain tensors."""
    out = {f"model.{k}": v.to_local().clone() for k, v in net.state_dict().items()}
    for i, state in enumerate(opt.state.values()):
        for name, value in state.items():
            local = value.to_local() if hasattr(value, "to_local") else value
            out[f"opt.{i}.{name}"] = local.clone()
    return out


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _resumed(run):
    return RunDir(run).events("checkpoint_resumed")[-1]


def test_a_sharded_loop_resumes_its_own_shards_from_memory_exactly(group, tmp_path):
    run, shm = tmp_path / "run", tmp_path / "shm"
    shm.mkdir()
    crashed, _, net, opt = _loop(run, shm, 13)
    facts = crashed.checkpointer.memory.facts
    assert facts["enabled"] and facts["off_reason"] is None and facts["step"] == 13
    assert not RunDir(run).events("memory_snapshots_off")
    want, rng_next = _local(net, opt), torch.rand(1)
    again, start, net2, opt2 = _loop(run, shm, 13)
    assert start == 13 and _same(_local(net2, opt2), want)  # weights and AdamW state, bit-exact
    assert torch.equal(torch.rand(1), rng_next)
    assert all(type(p).__name__ == "DTensor" for p in net2.parameters())
    resumed = _resumed(run)
    assert resumed["state_from"] == "memory snapshot" and resumed["step"] == 13
    assert resumed["durable_step"] == 10 and resumed["steps_kept"] == 3
    # and it trains on from there like the uninterrupted one
    ref, _, ref_net, ref_opt = _loop(tmp_path / "ref", shm, 14, crash=False)
    _, start, net3, opt3 = _loop(run, shm, 14)
    assert start == 13 and _same(_local(net3, opt3), _local(ref_net, ref_opt))
    again.close()


def test_a_snapshot_of_another_mesh_falls_back_to_the_durable_checkpoint(group, tmp_path):
    run, shm = tmp_path / "run", tmp_path / "shm"
    shm.mkdir()
    _loop(run, shm, 12)
    _, start, net, _ = _loop(run, shm, 12, mesh_shape=(1, 1), names=("replicate", "shard"))
    assert start == 10  # DCP's checkpoint, resharded onto the HSDP mesh
    why = _resumed(run)["memory_snapshot"]
    assert why == ("step 12's snapshot does not fit this job's sharded state (rank 0: the "
                   "snapshot's mesh is cpu shape [1] ('dp',), this rank at [0], this job's cpu "
                   "shape [1, 1] ('replicate', 'shard'), this rank at [0, 0]); the durable "
                   "checkpoint reshards")
    assert _resumed(run)["state_from"] == "checkpoint"


def test_other_placements_or_unsharded_state_fall_back_with_the_reason(group, tmp_path):
    run, shm = tmp_path / "run", tmp_path / "shm"
    shm.mkdir()
    _loop(run, shm, 12)
    _, start, _, _ = _loop(run, shm, 12, placement=lambda p: Shard(p.dim() - 1))
    assert start == 10
    assert "(rank 0: model.0.weight: placements (Shard(0)) in the snapshot, (Shard(1)) in " \
           "this job)" in _resumed(run)["memory_snapshot"]
    _loop(run, shm, 12)  # sharded snapshots again, then a job that is not sharded
    _, start, _, _ = _loop(run, shm, 12, sharded=False)
    assert start == 10 and "this job's state is not sharded" in _resumed(run)["memory_snapshot"]


def test_a_snapshot_of_another_world_size_is_not_used(group, tmp_path):
    run, shm = tmp_path / "run", tmp_path / "shm"
    shm.mkdir()
    _loop(run, shm, 10, crash=False)  # a durable checkpoint of step 10 at world size 1
    net, opt = _model()
    with_two = MemorySnapshots("every_step", None, rank=0, world_size=2, group=None,
                               config_hash=None, journal=lambda *a, **k: None)
    ours = Checkpoints.from_env(run, memory_snapshots="every_step",
                                memory_snapshots_dir=str(shm)).checkpointer.memory
    with_two.root, with_two.folder = ours.root, ours.folder  # rank 0 of 2's files, same run
    with_two.after_step(12, lambda: sharded.state_dicts({"model": net, "optimizer": opt}))
    with_two.wait()
    assert [(s.step, s.world_size) for s in store.sealed(ours.folder)] == [(12, 2)]
    _, start, _, _ = _loop(run, shm, 12)
    assert start == 10
    assert _resumed(run)["memory_snapshot"] == (
        "no rank has a usable snapshot (rank 0: step-000000000012.snap is of rank 0 at world "
        "size 2, this job's rank 0 at 1: another world size resumes from the durable "
        "checkpoint)")


def test_a_corrupt_shard_snapshot_is_rejected_and_the_one_before_is_used(group, tmp_path):
    run, shm = tmp_path / "run", tmp_path / "shm"
    shm.mkdir()
    crashed, _, _, _ = _loop(run, shm, 13)
    newest = store.sealed(crashed.checkpointer.memory.folder)[0]
    data = bytearray(newest.path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.path.write_bytes(bytes(data))
    _, start, _, _ = _loop(run, shm, 12)
    assert start == 12
    (rejected,) = RunDir(run).events("memory_snapshot_rejected")
    assert rejected["step"] == 13 and "digest mismatch" in rejected["ranks"]["0"]


def test_the_record_names_each_shards_place_and_rebuilds_it_on_the_jobs_mesh(group):
    net, opt = _model(mesh_shape=(1, 1), names=("replicate", "shard"))
    net(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    trees = sharded.state_dicts({"model": net, "optimizer": opt})
    local, record = shards.split(trees)
    assert record["meshes"] == [{"shape": [1, 1], "dim_names": ["replicate", "shard"],
                                 "device_type": "cpu", "coordinate": [0, 0]}]
    assert record["tensors"]["model.0.weight"] == {
        "mesh": 0, "placements": [["Replicate"], ["Shard", 0]], "shape": [8, 8],
        "stride": [8, 1], "local_shape": [8, 8], "dtype": "torch.float32"}
    assert "optimizer.state.2.bias.exp_avg" in record["tensors"]
    assert type(local["model"]["0.weight"]) is torch.Tensor
    live = sharded.models_of({"model": net})
    shards.fit(record, live, local)
    back = shards.rebuild(local, record, live)
    exp_avg = back["optimizer"]["state"]["2.bias"]["exp_avg"]
    assert exp_avg.placements == trees["optimizer"]["state"]["2.bias"]["exp_avg"].placements
    assert torch.equal(exp_avg.to_local(), trees["optimizer"]["state"]["2.bias"]["exp_avg"]
                       .to_local())
    for p in ([["_StridedShard", 0, 2]], [["Partial", "sum"]], [["Shard", 1]]):
        assert [shards.encode(shards.decode(x)) for x in p] == p
