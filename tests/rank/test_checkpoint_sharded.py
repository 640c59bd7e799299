"""Sharded (FSDP2, DTensor) state is saved through DCP with a manifest that covers it.

Before: a DTensor model's saves failed or sealed rank 0's shards only; then it was refused
as bad input. Now ``Checkpoints`` sees the DTensors, every rank writes its own shards
through ``torch.distributed.checkpoint.save``, and rank 0 seals a manifest listing every
file (digest, size) with the layout (world size, mesh, placements). A checkpoint whose
manifest or files do not cover its ``.metadata`` does not verify and is not resumed.
One-rank gloo group, 1-device CPU mesh; the 2-rank jobs are in
test_checkpoint_sharded_e2e.py."""

import ctypes
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from trainwatch import Checkpoints
from trainwatch.checkpoint_format.catalog import complete
from trainwatch.checkpoint_format.compat import check_compatible
from trainwatch.checkpoint_format.manifest import (DIGEST, MANIFEST, digest_file,
                                                    layout_problems, read_manifest, verify)
from trainwatch.errors import ConfigError, FormatError
from trainwatch.rank.checkpoint import resume as resume_mod, sharded_save
from trainwatch.rank.checkpoint.dcp_verify import verify_checkpoint
from trainwatch.rundir.run_dir import RunDir


def _fsdp2(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt


def _train(model, opt, steps=1):
    for _ in range(steps):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _full(model):
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def saved(group, tmp_path):
    """A run with one sharded checkpoint of step 2 (sync), and the state it holds."""
    model, opt = _fsdp2()
    run = RunDir(tmp_path / "run")
    ckpt = Checkpoints.from_env(run.root, every_steps=2, mode="sync", fsync=False)
    assert ckpt.resume(model=model, optimizer=opt, extra={"epoch": 0}) == 0
    for step in range(2):
        _train(model, opt)
        ckpt.maybe_save(step + 1, model=model, optimizer=opt, extra={"epoch": 7})
    ckpt.close(final=False)
    (entry,) = complete(run.checkpoint_dir)
    return run, entry.path, _full(model)


def test_an_fsdp2_model_is_saved_through_dcp_with_a_manifest_that_covers_it(saved):
    run, path, _ = saved
    manifest = read_manifest(path)
    assert manifest["layout"] == "dcp" and manifest["world_size"] == 1
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "rank-00000.pt"]
    assert manifest["dcp"]["files"] == ["__0_0.distcp"]
    assert manifest["dcp"]["ranks"] == {"0": [".metadata", "__0_0.distcp", "rank-00000.pt"]}
    assert manifest["dcp"]["mesh"] == {"shape": [1], "dim_names": ["dp"], "device_type": "cpu"}
    assert manifest["dcp"]["placements"]["model.0.weight"] == ["Shard(0)"]
    assert sorted(manifest["shared"]) == ["extra", "model", "optimizer"]
    assert verify_checkpoint(path).ok and not run.events("checkpoint_failed")
    assert not list(path.parent.glob(".tmp-*"))
    # plain DCP reads it without trainwatch
    fresh, _ = _fsdp2(seed=1)
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=str(path))
    assert torch.equal(state["model"]["0.weight"].full_tensor(), saved[2]["0.weight"])


def test_resume_loads_the_sharded_state_back_exactly_and_async_saves_follow(saved):
    run, path, weights = saved
    model, opt = _fsdp2(seed=1)
    extra, added = {"epoch": 0}, {"new": 1}
    ckpt = Checkpoints.from_env(run.root, every_steps=2, mode="async", fsync=False)
    assert ckpt.resume(model=model, optimizer=opt, extra=extra, added=added) == 2
    assert extra == {"epoch": 7} and added == {"new": 1}  # a key the checkpoint lacks: kept
    assert all(torch.equal(v, weights[k]) for k, v in _full(model).items())
    assert opt.state_dict()["state"][0]["step"].item() == 2.0
    for step in (3, 4, 5, 6):  # async: the writer thread writes what the loop copied
        _train(model, opt)
        ckpt.maybe_save(step, model=model, optimizer=opt, extra=extra)
    written_at_6 = _full(model)
    _train(model, opt)  # the loop goes on while step 6 is written: its copy is kept apart
    ckpt.close(final=False)
    assert [e.step for e in complete(run.checkpoint_dir)] == [6, 4, 2]
    assert [(e["step"], e["mode"]) for e in run.events("checkpoint_saved")] == [
        (2, "sync"), (4, "async"), (6, "async")]
    again, _ = _fsdp2(seed=2)
    ckpt = Checkpoints.from_env(run.root, mode="sync", fsync=False)
    assert ckpt.resume(model=again) == 6
    ckpt.close(final=False)
    assert all(torch.equal(v, written_at_6[k]) for k, v in _full(again).items())


def test_a_missing_or_corrupt_shard_does_not_verify_and_resume_passes_it_over(saved):
    run, path, _ = saved
    older = path.with_name("step-00000001")
    shutil.copytree(path, older)
    manifest = json.loads((older / MANIFEST).read_text())
    manifest["step"] = 1
    (older / MANIFEST).write_text(json.dumps(manifest))
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    assert "__0_0.distcp: xxh3_128 mismatch" in verify_checkpoint(path).reason
    chosen, passed = resume_mod.select([run.checkpoint_dir])
    assert chosen is not None and chosen.path == older
    assert [f.path for f in passed] == [path]
    shard.unlink()
    assert "__0_0.distcp: missing" in verify(path).reason


def test_a_manifest_that_does_not_list_what_the_metadata_names_is_refused(saved):
    _, path, _ = saved
    manifest = json.loads((path / MANIFEST).read_text())
    del manifest["files"]["__0_0.distcp"]
    manifest["dcp"]["files"] = []
    (path / MANIFEST).write_text(json.dumps(manifest))
    (path / "__0_0.distcp").unlink()  # as if a rank's shards were lost before the seal
    assert verify(path).ok  # the manifest's own records agree with the files...
    result = verify_checkpoint(path)  # ...but not with what .metadata names
    assert not result.ok
    assert "__0_0.distcp: named by .metadata, not in the manifest" in result.reason


def test_layout_problems_name_what_the_manifest_does_not_cover():
    files = {".metadata": {}, "__0_0.distcp": {}, "rank-00000.pt": {}}
    manifest = {"layout": "dcp", "world_size": 2, "files": files,
                "dcp": {"files": ["__0_0.distcp", "__1_0.distcp"]}}
    assert layout_problems(manifest) == [
        "__1_0.distcp: not in the manifest's files (the checkpoint does not hold the whole "
        "state)",
        "rank-00001.pt: not in the manifest's files (the checkpoint does not hold the whole "
        "state)"]
    assert layout_problems({"files": files}) == []  # data parallel
    assert "unknown layout 'zero3'" in layout_problems({"layout": "zero3", "files": files})[0]
    assert "without its 'dcp' files" in layout_problems({"layout": "dcp", "files": files})[0]


def test_only_a_dcp_layout_may_list_dot_metadata(tmp_path):
    entry = {"xxh3_128": "0" * 32, "bytes": 1}
    for layout, ok in ((None, False), ("dcp", True)):
        manifest = {"format": "trainwatch.checkpoint", "version": 1, "step": 1,
                    "files": {".metadata": entry}}
        if layout:
            manifest["layout"] = layout
        (tmp_path / MANIFEST).write_text(json.dumps(manifest))
        if ok:
            read_manifest(tmp_path)
        else:
            with pytest.raises(FormatError, match="bad entry for file '.metadata'"):
                read_manifest(tmp_path)


def test_a_checkpoint_of_either_kind_resumes_at_another_world_size_not_into_the_other_kind(
        tmp_path):
    check_compatible({"layout": "dcp", "world_size": 2}, tmp_path, config_hash=None)
    check_compatible({"world_size": 2}, tmp_path, config_hash=None)  # replicas: no resharding
    with pytest.raises(ConfigError, match="written by a data-parallel run"):
        check_compatible({"world_size": 2}, tmp_path, config_hash=None, sharded=True)


def test_a_new_rank_gets_rank_0s_data_position_and_a_derived_rng(saved):
    _, path, _ = saved
    manifest = read_manifest(path)
    state, resharded = resume_mod._rank_state(path, manifest, 2, 3)
    again, _ = resume_mod._rank_state(path, manifest, 2, 3)
    own, _ = resume_mod._rank_state(path, manifest, 0, 3)
    assert resharded == {"from_world_size": 1, "to_world_size": 3,
                         "data": "rank 0's position, on every rank", "rng_reseeded": [1, 2]}
    assert torch.equal(state["rng"]["torch"], again["rng"]["torch"])  # the same on restart
    assert not torch.equal(state["rng"]["torch"], own["rng"]["torch"])
    assert state["data"] == own["data"]


def test_an_optimizer_without_its_model_is_bad_input(group, tmp_path):
    model, opt = _fsdp2()
    _train(model, opt)
    ckpt = Checkpoints.from_env(tmp_path / "run", every_steps=1, mode="sync", fsync=False)
    with pytest.raises(ConfigError, match="a sharded optimizer needs its model passed too"):
        ckpt.maybe_save(1, optimizer=opt)
    ckpt.close(final=False)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_rank_whose_shards_fail_to_write_costs_no_checkpoint(saved, monkeypatch, mode):
    run, path, weights = saved
    model, opt = _fsdp2(seed=1)
    ckpt = Checkpoints.from_env(run.root, every_steps=1, mode=mode, fsync=False)
    assert ckpt.resume(model=model, optimizer=opt, extra={}) == 2

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp, "save", full_disk)
    _train(model, opt)
    ckpt.maybe_save(3, model=model, optimizer=opt, extra={})  # never raises into the loop
    ckpt.close(final=False)
    (failed,) = run.events("checkpoint_failed")
    assert failed["step"] == 3 and failed["errno"] == 28
    assert "failed on 1 of 1 rank(s): rank 0: OSError" in failed["error"]
    assert failed["previous"] == str(path)
    assert [e.step for e in complete(run.checkpoint_dir)] == [2]
    assert not list(run.checkpoint_dir.glob(".tmp-*"))
    assert verify_checkpoint(path).ok


def test_a_data_parallel_checkpoint_into_a_sharded_model_is_refused_with_the_way_out(
        group, tmp_path):
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    run = tmp_path / "run"
    ckpt = Checkpoints.from_env(run, every_steps=1, mode="sync", fsync=False)
    ckpt.maybe_save(1, model=plain)
    ckpt.close(final=False)
    model, _ = _fsdp2()
    ckpt = Checkpoints.from_env(run, every_steps=1, mode="sync", fsync=False)
    with pytest.raises(ConfigError, match="data-parallel checkpoint .* cannot be loaded into "
                                          "this sharded .*resume it without fully_shard"):
        ckpt.resume(model=model)
    ckpt.close(final=False)


def test_a_final_save_that_is_the_first_look_at_the_state_is_sharded_too(group, tmp_path):
    model, opt = _fsdp2()
    run = RunDir(tmp_path / "run")
    ckpt = Checkpoints.from_env(run.root, every_steps=100, mode="sync", fsync=False)
    _train(model, opt)
    ckpt.maybe_save(1, model=model, optimizer=opt)  # not due: nothing looked at yet
    ckpt.close()  # the final save
    (entry,) = complete(run.checkpoint_dir)
    assert entry.step == 1 and entry.manifest["layout"] == "dcp"
    fresh, fresh_opt = _fsdp2(seed=1)
    again = Checkpoints.from_env(run.root, mode="sync", fsync=False)
    assert again.resume(model=fresh, optimizer=fresh_opt) == 1
    again.close(final=False)
    assert all(torch.equal(v, _full(model)[k]) for k, v in _full(fresh).items())


def test_shard_digests_are_taken_as_dcp_writes_them_not_read_back(group, tmp_path,
                                                                   monkeypatch):
    """Before: every rank read its shard files back after dcp.save to hash them (a sixth
    of a sharded save); now DCP's writer hashes the bytes it writes (dcp_hashing.py)."""
    read_back = []
    real = sharded_save.digest_file
    monkeypatch.setattr(sharded_save, "digest_file",
                        lambda path, *a, **k: read_back.append(path.name) or real(path, *a, **k))
    model, opt = _fsdp2()
    _train(model, opt)
    ckpt = Checkpoints.from_env(tmp_path / "run", every_steps=1, mode="sync", fsync=False)
    ckpt.maybe_save(1, model=model, optimizer=opt)
    ckpt.close(final=False)
    (entry,) = complete(RunDir(tmp_path / "run").checkpoint_dir)
    assert read_back == []
    for name, recorded in entry.manifest["files"].items():  # the digests of the files
        assert digest_file(entry.path / name) == recorded[DIGEST], name
    assert verify_checkpoint(entry.path).ok


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_nan_in_a_ranks_shards_keeps_the_save_from_being_sealed(saved, mode):
    """The guard runs beside DCP's write now, not before it: what it finds still stops the
    seal, and the checkpoints a rollback returns to are kept."""
    run, path, _ = saved
    model, opt = _fsdp2(seed=1)
    ckpt = Checkpoints.from_env(run.root, every_steps=1, mode=mode, fsync=False)
    assert ckpt.resume(model=model, optimizer=opt) == 2
    _train(model, opt)
    with torch.no_grad():
        model[2].weight.to_local()[0, 0] = float("nan")
    ckpt.maybe_save(3, model=model, optimizer=opt)
    ckpt.close(final=False)
    (skipped,) = run.events("checkpoint_skipped")
    assert skipped["step"] == 3 and skipped["policy"] == "nonfinite"
    assert "model.2.weight" in skipped["reason"]
    assert [e.step for e in complete(run.checkpoint_dir)] == [2]
    assert not list(run.checkpoint_dir.glob(".tmp-*")) and verify_checkpoint(path).ok


def _peak_extra(work):
    """Bytes the process's peak resident set rose by during ``work()`` (Linux)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # resets VmHWM to the current resident set

    def status(key):
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(key))

    before = status("VmRSS:")
    work()
    return status("VmHWM:") - before


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux /proc only")
def test_an_async_save_holds_one_host_copy_of_the_shards(group, tmp_path):
    """Before: DCP's BlockingAsyncStager (uncached) deep-copied every DTensor, then copied
    it again: 2-3x the shard at its peak. Now what dcp.async_save uses, one copy."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(4)])
    fully_shard(model, mesh=init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    shard = sum(t.to_local().nbytes for t in model.parameters()) * 3  # weights, 2 moments
    ckpt = Checkpoints.from_env(tmp_path / "run", every_steps=1, mode="async", fsync=False)
    ckpt.maybe_save(1, model=model, optimizer=opt)  # the first: makes the writer's group
    ckpt.wait()
    extra = _peak_extra(lambda: (ckpt.maybe_save(2, model=model, optimizer=opt), ckpt.wait()))
    ckpt.close(final=False)
    assert extra / shard <= 1.1, f"{extra / shard:.2f} shards of extra memory"
    assert [e["step"] for e in RunDir(tmp_path / "run").events("checkpoint_saved")] == [1, 2]
