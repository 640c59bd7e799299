"""A snapshot every step walks the state against the previous walk (memory_snapshots/
rewalk.py): each snapshot must still be exactly its step's state, whatever changed in
between."""

import collections

import torch

from state_trees import assert_same_tree
from trainwatch.rank.memory_snapshots import payload, store
from trainwatch.rank.memory_snapshots.capture import HostCopy
from trainwatch.rank.memory_snapshots.resume import load_file


def _trees(model, opt):
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.LayerNorm(6),
                                torch.nn.Linear(6, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt


def _train(model, opt):
    model(torch.randn(4, 6)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _snap(tmp_path, host, tree, step):
    out, pairs = host.take(tree)
    host.copy(pairs)
    folder = store.make_folder(tmp_path / "rank-00000")
    doc = {"step": step, "shared": out, "rank": {"rng": None, "data": None}}
    sealed = store.seal(folder, rank=0, step=step, world_size=1, config_hash=None,
                        write=lambda f: payload.write(f, doc, host))
    restored, problem = load_file(sealed.path, step, 1)
    assert problem is None
    return restored.shared


def _same(a, b, where=""):
    assert_same_tree(a, b, where, same_types=True)


def test_each_snapshot_is_its_steps_state_through_changes_between_them(tmp_path):
    model, opt = _setup()
    host = HostCopy()
    layouts = []
    for step in range(1, 9):
        _train(model, opt)
        if step == 3:  # a value that is no tensor moves: this step's, not the walk's before
            opt.param_groups[0]["lr"] = 0.5
        if step == 4:  # a tensor replaced, same shape: its new storage is what is copied
            model[2].weight.data = model[2].weight.data.clone() + 1.0
        if step == 5:  # a key more (a buffer): a new layout
            model[0].register_buffer("seen", torch.full((2,), float(step)))
        if step == 7:  # another dtype under the same key, same shape: a new layout
            model[0].seen = torch.full((2,), step, dtype=torch.int64)
        tree = _trees(model, opt)
        expected = {"model": {k: v.clone() for k, v in tree["model"].items()},
                    "optimizer": {"state": {i: {k: v.clone() for k, v in s.items()}
                                            for i, s in tree["optimizer"]["state"].items()},
                                  "param_groups": tree["optimizer"]["param_groups"]}}
        shared = _snap(tmp_path / str(step), host, tree, step)
        _same(collections.OrderedDict(expected["model"]), shared["model"], f"step {step}")
        _same(expected["optimizer"], shared["optimizer"], f"step {step}")
        assert shared["model"]._metadata == tree["model"]._metadata
        layouts.append(id(host.layout))
    # walked again, not laid out anew, but where the tensors' dtypes or keys changed
    assert [layouts[i] == layouts[i - 1] for i in range(1, 8)] == \
        [True, True, True, False, True, False, True]
    assert host.frozen  # the model's state_dict and the optimizer's state were kept


def test_a_changed_shape_is_laid_out_anew_never_broadcast_into_the_old_view():
    host = HostCopy()
    out, pairs = host.take({"w": torch.ones(4), "b": torch.zeros(2)})
    host.copy(pairs)
    views = host.layout
    out, pairs = host.take({"w": torch.full((1,), 3.0), "b": torch.zeros(2)})  # broadcastable
    host.copy(pairs)
    assert host.layout is not views and out["w"].shape == (1,) and out["w"].item() == 3.0


def test_a_tensor_that_requires_grad_is_copied_not_recorded_by_autograd():
    """Walked again, the sources are the state's own tensors, not detached copies: the
    arena's views must not join their graph."""
    weight = torch.nn.Parameter(torch.ones(3))
    host = HostCopy()
    for value in (2.0, 3.0):  # the second capture is the walk against the first
        with torch.no_grad():
            weight.fill_(value)
        out = host.capture({"w": weight})
        assert not out["w"].requires_grad and out["w"].tolist() == [value] * 3
