"""A memory snapshot's payload (trainwatch/rank/memory_snapshots/payload.py): raw tensor
bytes and a small index, read back exactly; a torn, altered or foreign file is a reason."""

import collections
import io
import os
import pickle

import pytest
import torch

from trainwatch.rank.memory_snapshots import payload, store
from trainwatch.rank.memory_snapshots.capture import HostCopy
from trainwatch.rank.memory_snapshots.resume import load_file


def _state():
    model = collections.OrderedDict(w=torch.randn(3, 5), b=torch.arange(4, dtype=torch.int64))
    model._metadata = {"": {"version": 1}}  # what nn.Module.state_dict carries
    return {"model": model,
            "optimizer": {"state": {0: {"step": torch.tensor(7.0),
                                        "exp_avg": torch.randn(3, 5).to(torch.bfloat16)}},
                          "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]},
            "extra": (torch.zeros(0, 4), torch.tensor([True, False]),
                      torch.randn(4, 2).t(), torch.randn(3, 3).to_sparse())}


def _seal(tmp_path, tree, host):
    folder = store.make_folder(tmp_path / "root" / "rank-00000")
    return store.seal(folder, rank=0, step=5, world_size=1, config_hash=None,
                      write=lambda f: payload.write(f, tree, host))


def _same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert a.layout == b.layout and torch.equal(a.to_dense(), b.to_dense())
    elif isinstance(a, (dict, list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a.values() if isinstance(a, dict) else a,
                        b.values() if isinstance(b, dict) else b):
            _same(x, y)
        if isinstance(a, dict):
            assert list(a) == list(b)
    else:
        assert a == b


def test_a_snapshot_reads_back_exactly_every_dtype_shape_and_container(tmp_path):
    state, host = _state(), HostCopy()
    shared = host.capture(state)
    snap = _seal(tmp_path, {"step": 5, "shared": shared,
                            "rank": {"rng": {"torch": torch.get_rng_state()}, "data": None}}, host)
    restored, problem = load_file(snap.path, 5, 1)
    assert problem is None
    _same(state, restored.shared)
    assert restored.shared["model"]._metadata == {"": {"version": 1}}
    assert torch.equal(restored.rank_state["rng"]["torch"], torch.get_rng_state())
    assert host.arena.numel() > 0 and snap.bytes > host.arena.numel()  # the arena, raw


@pytest.mark.parametrize("damage", ["torn", "digest", "foreign", "pickled code"])
def test_a_torn_altered_or_foreign_file_is_a_reason_not_a_traceback(tmp_path, damage):
    host = HostCopy()
    snap = _seal(tmp_path, {"step": 5, "shared": host.capture({"w": torch.randn(64)}),
                            "rank": {}}, host)
    data = bytearray(snap.path.read_bytes())
    if damage == "torn":
        data = data[:-100]
    elif damage == "digest":
        data[-1] ^= 0xFF
    else:  # a whole, well-sealed file whose payload is not ours: the digest matches it
        class Boom:
            def __reduce__(self):
                return (os.system, ("true",))
        body = (os.urandom(4096) if damage == "foreign" else
                len(raw := pickle.dumps(Boom())).to_bytes(8, "little") + raw)
        snap = store.seal(snap.path.parent, rank=0, step=6, world_size=1, config_hash=None,
                          write=lambda f: f.write(body))
        data = bytearray(snap.path.read_bytes())
    snap.path.write_bytes(bytes(data))
    restored, problem = load_file(snap.path, snap.step, 1)
    assert restored is None
    assert {"torn": "torn", "digest": "digest mismatch", "foreign": "payload",
            "pickled code": "unreadable payload index"}[damage] in problem


def test_an_old_torch_save_snapshot_still_loads(tmp_path):
    """Version 2 files (``torch.save``'d payloads) left by the trainwatch before this one."""
    folder = store.make_folder(tmp_path / "root" / "rank-00000")
    state = {"step": 3, "shared": {"w": torch.randn(4)}, "rank": {"data": 1}}
    buf = io.BytesIO()
    torch.save(state, buf)
    snap = store.seal(folder, rank=0, step=3, world_size=1, config_hash=None,
                      write=lambda f: f.write(buf.getvalue()))
    raw = snap.path.read_bytes()
    head = raw[:store.HEADER_BYTES].replace(b'"version": 3', b'"version": 2')
    snap.path.write_bytes(head + raw[store.HEADER_BYTES:])
    restored, problem = load_file(snap.path, 3, 1)
    assert problem is None and torch.equal(restored.shared["w"], state["shared"]["w"])
