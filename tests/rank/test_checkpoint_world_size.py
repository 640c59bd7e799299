"""A data-parallel checkpoint resumes at another world size (a job that lost a node goes on
with fewer ranks, and grows back when it returns): the replicated model and optimizer load
on any rank; the per-rank state follows docs/checkpoints.md, "Another world size"."""

import torch

from trainwatch import Checkpoints
from trainwatch.checkpoint_format.catalog import complete
from trainwatch.checkpoint_format.manifest import read_manifest
from trainwatch.rank.checkpoint import resume as resume_mod
from trainwatch.rundir.run_dir import RunDir


def _saved(tmp_path):
    """One data-parallel checkpoint of step 1 written by a world of 1 (the `group`
    fixture's one gloo rank)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    run = RunDir(tmp_path / "run")
    ckpt = Checkpoints.from_env(run.root, every_steps=1, mode="sync", fsync=False)
    assert ckpt.resume(model=model, optimizer=opt) == 0
    ckpt.maybe_save(1, model=model, optimizer=opt, data={"samples": 96})
    ckpt.close(final=False)
    (entry,) = complete(run.checkpoint_dir)
    return entry.path, model


def test_a_data_parallel_checkpoint_loads_on_more_or_fewer_ranks(group, tmp_path):
    path, model = _saved(tmp_path)
    manifest = read_manifest(path)
    assert manifest["world_size"] == 1 and manifest.get("layout") != "dcp"
    same = resume_mod.load(path, manifest, 0, 1)
    assert same.resharded is None
    grown = resume_mod.load(path, manifest, 2, 3)  # a rank the checkpoint did not have
    assert grown.resharded == {"from_world_size": 1, "to_world_size": 3,
                               "data": "rank 0's position, on every rank", "rng_reseeded": [1, 2]}
    # The replicas are the ones saved; the job's global position goes to every rank.
    assert set(grown.shared) == set(same.shared)
    for name, tensor in model.state_dict().items():
        assert torch.equal(grown.shared["model"][name], tensor)
    assert grown.data == same.data == {"samples": 96}
    assert not torch.equal(grown.rank_state["rng"]["torch"], same.rank_state["rng"]["torch"])
