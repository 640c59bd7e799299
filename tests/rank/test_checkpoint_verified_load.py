"""Resume reads each checkpoint file once: hashed as it is read, loaded from those bytes.

Before, every file was read twice at resume, once by the digest check and once by
torch.load (1.53-1.84x torch.load + load_state_dict at 289 MB, issue #38). Now a file is
read once, each tensor straight into its own storage, and unpickled only when the digest
matches; a damaged file is reported as the two-pass check reported it, and never parsed."""

import json

import pytest
import torch

from trainwatch import Checkpoints
from trainwatch.checkpoint_format import manifest as manifest_mod
from trainwatch.checkpoint_format.manifest import check_file
from trainwatch.rank.checkpoint.verified_load import load_verified
from trainwatch.rundir.run_dir import RunDir


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.stride() == b.stride() and torch.equal(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


@pytest.fixture
def saved(tmp_path):
    """A checkpoint file of awkward state (views of one storage, empty and 0-d tensors,
    several dtypes) with its manifest entry."""
    base = torch.arange(24, dtype=torch.float32)
    state = {"a": base[:12].view(3, 4), "b": base[6:].view(2, 9).t(), "e": torch.empty(0),
             "s": torch.tensor(3), "h": torch.randn(5, dtype=torch.bfloat16),
             "nest": {"list": [torch.ones(2, dtype=torch.int64), 7, "x"], "none": None}}
    path = tmp_path / "state.pt"
    torch.save(state, path)
    entry = {"xxh3_128": manifest_mod.digest_file(path), "bytes": path.stat().st_size}
    return tmp_path, path, entry


def test_loads_what_torch_load_loads_each_storage_its_own(saved):
    folder, path, entry = saved
    value, problem = load_verified(folder, path.name, entry)
    assert problem is None
    assert _same(value, torch.load(path, weights_only=True))
    assert value["a"].untyped_storage().data_ptr() == value["b"].untyped_storage().data_ptr()
    assert value["h"].untyped_storage().nbytes() == 10  # not a view of one buffer of the file


@pytest.mark.parametrize("where", [-30, 0.5, 10])  # central directory, the tensors, a header
def test_a_damaged_file_is_reported_as_the_digest_check_reports_it(saved, where, monkeypatch):
    folder, path, entry = saved
    data = bytearray(path.read_bytes())
    data[int(len(data) * where) if isinstance(where, float) else where] ^= 0x10
    path.write_bytes(bytes(data))
    monkeypatch.setattr(torch.serialization, "_load", None)  # never unpickled
    value, problem = load_verified(folder, path.name, entry)
    assert value is None and problem == check_file(folder, path.name, entry)[1] == (
        "state.pt: xxh3_128 mismatch (content changed or corrupt)")
    path.write_bytes(bytes(data[:-1]))
    assert load_verified(folder, path.name, entry) == (
        None, f"state.pt: size {len(data) - 1} bytes, manifest says {len(data)}")


def test_resume_reads_each_file_once(group, tmp_path, monkeypatch):
    """No second pass: neither the digest check's read nor torch.load runs, and the
    weights, the optimizer and the data position come back exactly."""
    run = RunDir(tmp_path / "run")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():  # state without a step: the first step imports for seconds
        opt.state[p]["momentum_buffer"] = torch.randn_like(p)
    with Checkpoints.from_env(run.root, every_steps=1, mode="sync", fsync=False) as ckpt:
        ckpt.maybe_save(1, model=model, optimizer=opt, data={"position": 5})
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = json.dumps(str(opt.state_dict()))
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)

    def second_pass(*args, **kwargs):
        raise AssertionError("a checkpoint file was read a second time")
    monkeypatch.setattr(manifest_mod, "digest_file", second_pass)
    monkeypatch.setattr(torch, "load", second_pass)
    data: dict = {}
    with Checkpoints.from_env(run.root, every_steps=1, mode="sync") as again:
        assert again.resume(model=fresh, optimizer=fresh_opt, data=data) == 1
        again.close(final=False)
    assert _same(dict(fresh.state_dict()), weights) and data == {"position": 5}
    assert json.dumps(str(fresh_opt.state_dict())) == moments
