"""An async save hands each tree to the writer as soon as it is copied; the NaN/Inf guard
runs alongside the write. Neither may cost crash safety or the previous checkpoint."""

import threading
import time

import numpy as np
import pytest
import torch

from trainwatch.rundir.run_dir import RunDir
from trainwatch.checkpoint_format import catalog
from trainwatch.rank.checkpoint import CheckpointConfig, Checkpointer
from trainwatch.checkpoint_format.manifest import verify
from trainwatch.rank.checkpoint.nonfinite import nonfinite_state
from trainwatch.rank.checkpoint.snapshot import HostSnapshot


def _checkpointer(tmp_path, **cfg):
    RunDir(tmp_path / "run").create()
    return Checkpointer(CheckpointConfig(every_steps=1, fsync=False, **cfg),
                        tmp_path / "run").start()


def _state():
    return {"model": {"w": torch.randn(1000)}, "optimizer": {"m": torch.randn(1000)},
            "data": {"position": 1}}


def test_on_the_cpu_the_writer_copies_alongside_the_loop_and_writes_after(tmp_path, monkeypatch):
    ckpt = _checkpointer(tmp_path)
    state = {"model": {"w": torch.randn(3 << 20)}, "optimizer": {"m": torch.randn(3 << 20)},
             "data": {"position": 1}}  # 12 MB a tree: three chunks each
    expected = {k: {n: t.clone() for n, t in v.items()} for k, v in state.items() if k != "data"}
    loop, original = threading.current_thread(), np.copyto
    copiers, files_while_copying, helped = [], [], threading.Event()

    def copyto(dst, src, **kwargs):
        if threading.current_thread() is loop:
            helped.wait(timeout=10)  # hold the loop's first chunk until the writer took one
            files_while_copying.extend(ckpt.folder.glob(".tmp-step-*/[mo]*.pt"))
        original(dst, src, **kwargs)
        copiers.append(threading.current_thread().name)
        if threading.current_thread() is not loop:
            helped.set()

    monkeypatch.setattr(np, "copyto", copyto)
    ckpt.after_step(1, lambda: state)
    monkeypatch.undo()
    for tree in state.values():  # the loop goes on: the copy is the checkpoint
        for t in tree.values() if isinstance(tree, dict) else []:
            if isinstance(t, torch.Tensor):
                t.zero_()
    ckpt.close()
    assert "trainwatch-checkpoint-writer" in copiers and loop.name in copiers
    assert files_while_copying == [], "the writer wrote while the loop was still copying"
    newest = catalog.complete(ckpt.folder)[0]
    assert newest.step == 1 and verify(newest.path).ok
    for name, tree in expected.items():
        saved = torch.load(newest.path / f"{name}.pt", weights_only=True)
        assert all(saved[k].equal(v) for k, v in tree.items())


def test_ctrl_c_while_the_writer_shares_the_copy_reaches_the_loop_and_publishes_nothing(
        tmp_path, monkeypatch):
    ckpt = _checkpointer(tmp_path)
    state = {"model": {"w": torch.randn(6 << 20)}, "optimizer": {"m": torch.randn(6 << 20)},
             "data": {"position": 1}}
    loop, original = threading.current_thread(), np.copyto
    helped = threading.Event()

    def copyto(dst, src, **kwargs):
        if threading.current_thread() is loop:
            helped.wait(timeout=10)
            raise KeyboardInterrupt  # while the writer copies a chunk of its own
        original(dst, src, **kwargs)
        helped.set()

    monkeypatch.setattr(np, "copyto", copyto)
    with pytest.raises(KeyboardInterrupt):
        ckpt.after_step(1, lambda: state)
    monkeypatch.undo()
    waiting = threading.Thread(target=ckpt.wait, daemon=True)
    waiting.start()
    waiting.join(timeout=60)
    assert not waiting.is_alive(), "the writer waits for a copy the interrupted loop gave up"
    ckpt.close()
    assert helped.is_set() and catalog.complete(ckpt.folder) == []
    assert not any(p.name.startswith(".tmp-") for p in ckpt.folder.iterdir())
    assert RunDir(tmp_path / "run").events("checkpoint_failed")[0]["step"] == 1


def test_with_nothing_to_share_the_writer_starts_on_the_model_while_the_optimizer_is_copied(
        tmp_path, monkeypatch):
    """As from a GPU, where the copies are the device's: a strided tensor is copied by torch,
    with nothing for the writer to take, so it writes each tree once it is copied."""
    ckpt = _checkpointer(tmp_path)
    folder = ckpt.folder
    started_model = threading.Event()
    original = HostSnapshot.copy

    def copy(self, tree, **kwargs):
        if "m" in tree:  # the optimizer: hold the copy until model.pt is being written
            started_model.wait(timeout=30)
        return original(self, tree, **kwargs)

    def model_file_seen():
        while not started_model.is_set():
            if any(folder.glob(".tmp-step-*/model.pt")):
                started_model.set()
            elif not watching.is_set():
                return
            threading.Event().wait(0.005)

    watching = threading.Event()
    watching.set()
    watcher = threading.Thread(target=model_file_seen, daemon=True)
    watcher.start()
    monkeypatch.setattr(HostSnapshot, "copy", copy)
    strided = {"model": {"w": torch.randn(1000, 2).t()}, "optimizer": {"m": torch.randn(1000)},
               "data": {"position": 1}}
    try:
        held = time.perf_counter()
        ckpt.after_step(1, lambda: strided)
        held = time.perf_counter() - held
        ckpt.wait()
    finally:
        watching.clear()
        watcher.join(timeout=30)
        ckpt.close()
    assert started_model.is_set() and held < 25, "model.pt was not written until the whole state was copied"
    newest = catalog.complete(folder)[0]
    assert newest.step == 1 and verify(newest.path).ok


def test_a_failed_copy_keeps_the_previous_checkpoint_and_leaves_nothing(tmp_path, monkeypatch):
    ckpt = _checkpointer(tmp_path)
    ckpt.after_step(1, _state)
    ckpt.wait()
    original = HostSnapshot.copy

    def copy(self, tree, **kwargs):
        if "m" in tree:
            raise MemoryError("no host memory for the copy")
        return original(self, tree, **kwargs)

    monkeypatch.setattr(HostSnapshot, "copy", copy)
    ckpt.after_step(2, _state)
    ckpt.wait()
    ckpt.close()
    failed = RunDir(tmp_path / "run").events("checkpoint_failed")
    assert len(failed) == 1 and failed[0]["step"] == 2 and "host memory" in failed[0]["error"]
    kept = catalog.complete(ckpt.folder)
    assert [e.step for e in kept] == [1] and failed[0]["previous"] == str(kept[0].path)
    assert not any(p.name.startswith(".tmp-") for p in ckpt.folder.iterdir())


def test_ctrl_c_during_the_copy_reaches_the_loop_and_close_does_not_hang(tmp_path, monkeypatch):
    ckpt = _checkpointer(tmp_path)
    original = HostSnapshot.copy

    def copy(self, tree, **kwargs):
        if "m" in tree:
            raise KeyboardInterrupt
        return original(self, tree, **kwargs)

    monkeypatch.setattr(HostSnapshot, "copy", copy)
    with pytest.raises(KeyboardInterrupt):
        ckpt.after_step(1, _state)
    waiting = threading.Thread(target=ckpt.wait, daemon=True)  # what close() waits on
    waiting.start()
    waiting.join(timeout=60)
    assert not waiting.is_alive(), "the writer waits for a tree the interrupted copy never hands over"
    ckpt.close()
    assert catalog.complete(ckpt.folder) == []
    assert not any(p.name.startswith(".tmp-") for p in ckpt.folder.iterdir())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_poisoned_state_written_alongside_the_guard_is_never_published(tmp_path, mode):
    ckpt = _checkpointer(tmp_path, mode=mode)
    ckpt.after_step(1, _state)
    bad = _state()
    bad["optimizer"]["m"][7] = float("inf")
    ckpt.after_step(2, lambda: bad)
    ckpt.wait()
    ckpt.close()
    skipped = RunDir(tmp_path / "run").events("checkpoint_skipped")
    assert skipped and skipped[-1]["policy"] == "nonfinite" and "optimizer.m" in skipped[-1]["reason"]
    assert [e.step for e in catalog.complete(ckpt.folder)] == [1]
    assert not any(p.name.startswith(".tmp-") for p in ckpt.folder.iterdir())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_the_guard_sees_nan_and_both_infinities_in_every_float_dtype(dtype):
    for bad in (float("nan"), float("inf"), float("-inf")):
        tree = {"ok": torch.zeros(5, dtype=dtype), "empty": torch.zeros(0, dtype=dtype),
                "ints": torch.arange(3), "bad": [torch.zeros(4, 3, dtype=dtype)]}
        tree["bad"][0][2, 1] = bad
        assert nonfinite_state(tree, "model") == ["model.bad.0"]


def test_the_guard_names_exactly_the_bad_tensors_huge_values_and_float8_included():
    """Huge finite values are not refused. Float8 has neither min/max nor isfinite on
    CPU: before, its check raised and the save failed."""
    tree = {"huge": torch.full((64,), 3e38), "f8": torch.zeros(3).to(torch.float8_e4m3fn),
            "f8_ok": torch.ones(2).to(torch.float8_e4m3fn), "b": torch.ones(2),
            "a": torch.tensor([1.0, float("nan")], dtype=torch.float16)}
    tree["f8"][1] = float("nan")
    assert nonfinite_state(tree) == ["f8", "a"]


def test_the_guard_checks_host_tensors_on_its_own_thread_not_with_torchs_reductions(
        monkeypatch):
    """torch's reductions split a large tensor across the intra-op threads; beside
    torch.save on a busy 2-core host those spun, and checking 1 GB took 0.5-1.8 s
    instead of 0.07 (issue #38). The host check reads the exponent bits in numpy."""
    def refused(*args, **kwargs):
        raise AssertionError("a torch reduction ran for a host tensor's check")

    monkeypatch.setattr(torch, "aminmax", refused)
    monkeypatch.setattr(torch, "isfinite", refused)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        info = torch.finfo(dtype)
        edge = torch.tensor([info.max, -info.max, info.tiny / 4, -0.0], dtype=dtype)
        big = torch.ones(3 << 20, dtype=dtype)  # several of the check's chunks
        tree = {"edge": edge, "big": big, "strided": big[::3]}
        assert nonfinite_state(tree) == [], dtype
        big[(3 << 20) - 3] = float("-inf")  # in the strided view too
        assert nonfinite_state(tree) == ["big", "strided"], dtype
        big[(3 << 20) - 3], big[-1] = 1.0, float("nan")  # the last chunk's last element
        assert nonfinite_state(tree) == ["big"], dtype


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_saved_state_is_the_state_at_the_save_step_whatever_the_loop_does_next(
        tmp_path, monkeypatch, mode):
    """maybe_save returns only once the state is copied: the loop may then change every
    weight and moment in place (here before the writer is even let go)."""
    from trainwatch import Checkpoints
    from trainwatch.rank.checkpoint import checkpointer as checkpointer_mod

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    let_go, original = threading.Event(), checkpointer_mod.write_checkpoint

    def write_checkpoint(*args, **kwargs):
        assert let_go.wait(timeout=60)
        return original(*args, **kwargs)

    monkeypatch.setattr(checkpointer_mod, "write_checkpoint", write_checkpoint)
    ckpt = Checkpoints(tmp_path / "run", CheckpointConfig(mode=mode, every_steps=1, fsync=False))
    if mode == "sync":
        let_go.set()
    expected = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                "optimizer": [s["exp_avg"].clone() for s in opt.state_dict()["state"].values()]}
    assert ckpt.maybe_save(1, model=model, optimizer=opt)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
            opt.state[p]["exp_avg"].mul_(-3.0)
    let_go.set()
    ckpt.close(final=False)
    saved = catalog.complete(ckpt.checkpointer.folder)[0].path
    weights = torch.load(saved / "model.pt", weights_only=True)
    moments = torch.load(saved / "optimizer.pt", weights_only=True)["state"]
    assert all(weights[k].equal(v) for k, v in expected["model"].items())
    assert all(moments[i]["exp_avg"].equal(m) for i, m in enumerate(expected["optimizer"]))
