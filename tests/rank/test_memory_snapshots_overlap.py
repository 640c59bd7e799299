"""A large state's snapshot copied beside the next step (memory_snapshots/overlap.py): each
sealed snapshot holds exactly its step's state, through structure changes mid-run, and one
whose tensors changed while they were copied is never sealed."""

import copy

import pytest
import torch

from state_trees import assert_same_tree
from trainwatch.rank.checkpoint import Checkpoints
from trainwatch.rank.memory_snapshots import overlap, store
from trainwatch.rank.memory_snapshots import payload as payload_format
from trainwatch.rundir.run_dir import RunDir


@pytest.fixture(autouse=True)
def every_state_overlaps(monkeypatch):
    monkeypatch.setattr(overlap, "OVERLAP_BYTES", 0)  # the tests' small state is "large"


def _setup(tmp_path):
    (tmp_path / "shm").mkdir()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 4))  # BatchNorm: buffers change in forward
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ckpt = Checkpoints.from_env(tmp_path / "run", every_steps=0, fsync=False,
                                memory_snapshots="every_step",
                                memory_snapshots_dir=str(tmp_path / "shm"))
    return model, opt, ckpt


def _read(folder, step):
    (sealed,) = [s for s in store.sealed(folder) if s.step == step]
    store.verify(sealed.path)
    return payload_format.decode(store.payload(sealed.path))["shared"]


def _state(model, opt):
    return copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})


def test_each_snapshot_is_its_steps_state_through_structure_changes(tmp_path):
    model, opt, ckpt = _setup(tmp_path)
    memory = ckpt.checkpointer.memory
    extra = torch.nn.Parameter(torch.ones(4))
    expected, deferred = {}, []
    for step in range(1, 9):
        if step == 4:  # a param group added: more tensors, a new layout
            opt.add_param_group({"params": [extra], "lr": 0.1})
        if step == 6:  # a tensor replaced under the same shape: its new storage is copied
            model[2].weight.data = model[2].weight.data.clone() + 1.0
        loss = (model(torch.randn(16, 8)) + extra).square().mean()
        loss.backward()
        opt.step()  # the pre-step hook settled the previous snapshot's copy
        opt.zero_grad()
        if step > 1:
            memory._writer.wait()  # sealed: what was copied is exactly that step's state
            assert_same_tree(expected[step - 1], _read(memory.folder, step - 1), f"step {step - 1}")
        ckpt.maybe_save(step, model=model, optimizer=opt)
        expected[step] = _state(model, opt)
        deferred.append(len(memory._overlap._later))
    memory.wait()
    assert_same_tree(expected[8], _read(memory.folder, 8), "step 8")
    # Beside the next step: the optimizer's tensors (6 parameters and AdamW's 3 tensors of
    # each; with the group added, 3 more), but at a new layout's first snapshot (steps 1, 4),
    # never BatchNorm's buffers (changed in the forward) and not the replaced weight's new
    # storage (step 6: no optimizer's tensor that the layout's learning step saw).
    assert deferred == [0, 24, 24, 0, 27, 26, 26, 26]
    assert memory.facts["changed_total"] == 0 and memory.facts["taken_total"] == 8
    ckpt.close()


def test_a_tensor_changed_while_it_was_copied_is_not_sealed(tmp_path):
    """Changed in place after the step's end and before the optimizer's step (the copy may
    have read half of it): that snapshot is dropped, the one before kept, and from then on
    that tensor is copied at the step boundary."""
    model, opt, ckpt = _setup(tmp_path)
    memory = ckpt.checkpointer.memory
    expected = {}
    for step in range(1, 6):
        if step == 4:
            with torch.no_grad():
                model[0].weight.mul_(0.5)  # in the window of step 3's deferred copy
        model(torch.randn(16, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ckpt.maybe_save(step, model=model, optimizer=opt)
        expected[step] = _state(model, opt)
        if step == 3:
            assert memory._overlap._later  # step 3's weights are copied beside step 4
    memory.wait()
    assert memory.facts["changed_total"] == 1 and memory.facts["taken_total"] == 4
    assert [s.step for s in store.sealed(memory.folder)] == [5, 4]  # 3 was never sealed
    assert_same_tree(expected[4], _read(memory.folder, 4), "step 4")
    assert_same_tree(expected[5], _read(memory.folder, 5), "step 5")
    assert 0 in memory._overlap._now  # model.0.weight: copied at the boundary from now on
    (skipped,) = RunDir(tmp_path / "run").events("memory_snapshot_skipped")
    assert skipped["kind"] == "changed" and skipped["step"] == 3
    assert skipped["reason"].startswith("1 tensor(s) of the state changed in place while")
    ckpt.close()
