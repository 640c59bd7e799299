"""A snapshot every step reads the live tensors once the layout is known, without
``state_dict()`` (memory_snapshots/live.py): each snapshot must still be exactly its step's
``state_dict()``s, whatever changed between two steps."""

import torch

from state_trees import assert_same_tree
from trainwatch.rank.checkpoint import Checkpoints
from trainwatch.rank.memory_snapshots import store
from trainwatch.rank.memory_snapshots.resume import load_file


def _add_key(module, state, prefix, local_metadata):
    state[prefix + "hooked"] = torch.full((2,), 7.0)


def test_each_snapshot_is_its_steps_state_dicts_through_layout_changes(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.LayerNorm(6),
                                torch.nn.Linear(6, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)  # its state comes at its first step
    (tmp_path / "shm").mkdir()
    ckpt = Checkpoints.from_env(tmp_path / "run", every_steps=0, save_final=False,
                                fsync=False, memory_snapshots="every_step",
                                memory_snapshots_dir=str(tmp_path / "shm"))
    memory = ckpt.checkpointer.memory
    fast = []
    for step in range(1, 25):
        if step == 6:  # a new parameter and param group
            model.extra = torch.nn.Parameter(torch.randn(4))
            opt.add_param_group({"params": [model.extra], "lr": 0.02})
        if step == 9:  # a parameter replaced, same shape; the optimizer follows it
            old = model[0].weight
            model[0].weight = torch.nn.Parameter(old.detach() * 2)
            opt.param_groups[0]["params"][0] = model[0].weight
            opt.state[model[0].weight] = opt.state.pop(old)
        if step == 12:  # a parameter's data replaced, same shape
            with torch.no_grad():
                model[2].bias.data = torch.randn(3)
        if step == 14:  # a group's value moves (a schedule)
            opt.param_groups[0]["lr"] = 0.5
        if step == 16:  # a state_dict hook: its key must be in the snapshot
            hook = model[1].register_state_dict_post_hook(_add_key)
        if step == 19:
            hook.remove()
        if step == 21:  # an optimizer state tensor replaced
            state = opt.state[model[2].weight]
            state["exp_avg"] = state["exp_avg"].clone() + 1
        out = model(torch.randn(5, 6)).square().mean() + model.extra.sum() \
            if step >= 6 else model(torch.randn(5, 6)).square().mean()
        out.backward()
        opt.step()
        opt.zero_grad()
        before = memory._live.fast_total
        ckpt.maybe_save(step, model=model, optimizer=opt)
        memory.wait()
        fast.append(memory._live.fast_total > before)
        assert memory.facts["taken_total"] == step, memory.facts
        newest = store.sealed(memory.folder)[0]
        assert newest.step == step
        restored, problem = load_file(newest.path, step, 1)
        assert problem is None
        assert_same_tree(restored.shared, {"model": model.state_dict(), "optimizer": opt.state_dict()},
              f"step {step}")
    ckpt.close()
    # the live way was taken while nothing moved, and not at the steps where something did
    assert sum(fast) >= 12
    for changed in (6, 9, 16, 21):
        assert not fast[changed - 1], changed
    assert fast[3] and fast[7] and fast[13] and fast[23]
