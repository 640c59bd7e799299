"""Every rank hashes its share of a checkpoint at resume; rank 0 hears the verdict.

Before: rank 0 alone hashed every rank's files while the others waited (a third of a
sharded resume, docs/benchmarks.md). Now each rank is sent its own files and a fair share
of the rest, and the verdict (and so the fallback past a bad file) is the one a single
rank hashing everything reaches. Here one real gloo rank; the 2-rank fallback runs in
test_checkpoint_sharded_e2e.py."""

import torch

from trainwatch import Checkpoints
from trainwatch.rank.checkpoint import resume as resume_mod
from trainwatch.rank.checkpoint.dcp_verify import verify_checkpoint
from trainwatch.rank.checkpoint.parallel_verify import ParallelVerify, shares
from trainwatch.rundir.run_dir import RunDir


def _entry(size):
    return {"xxh3_128": "0" * 32, "bytes": size}


def test_each_rank_gets_its_own_files_and_the_rest_is_spread_by_size():
    files = {"__0_0.distcp": _entry(100), "__1_0.distcp": _entry(100),
             "__2_0.distcp": _entry(100), "rank-00000.pt": _entry(1),
             "rank-00001.pt": _entry(1), "rank-00002.pt": _entry(1), ".metadata": _entry(5),
             "model.pt": _entry(300), "optimizer.pt": _entry(50)}
    two = shares(files, 2)
    assert {"__0_0.distcp", "rank-00000.pt", ".metadata"} <= set(two[0])  # rank 0 reads it
    assert {"__1_0.distcp", "rank-00001.pt"} <= set(two[1])
    # what no rank of this job wrote: biggest first, each to the least loaded rank
    assert "model.pt" in two[1] and {"__2_0.distcp", "optimizer.pt"} <= set(two[0])
    assert sorted(n for share in two for n in share) == sorted(files)
    assert shares(files, 1) == [files]


def test_the_verdict_and_the_fallback_are_those_of_one_rank_hashing_everything(group,
                                                                              tmp_path):
    run = RunDir(tmp_path / "run")
    model = torch.nn.Linear(4, 2)
    ckpt = Checkpoints.from_env(run.root, every_steps=1, mode="sync", fsync=False)
    for step in (1, 2):
        ckpt.maybe_save(step, model=model)
    ckpt.close(final=False)
    newest = run.checkpoint_dir / "step-00000002"
    data = bytearray((newest / "model.pt").read_bytes())
    data[-10] ^= 1
    (newest / "model.pt").write_bytes(bytes(data))
    verifier = ParallelVerify(0, 1, torch.distributed.group.WORLD)
    alone = verify_checkpoint(newest)
    shared = verifier.verify(newest)
    assert not shared.ok and shared.problems == alone.problems == [
        "model.pt: xxh3_128 mismatch (content changed or corrupt)"]
    chosen, passed = resume_mod.select([run.checkpoint_dir], verifier.verify)
    assert chosen is not None and chosen.path.name == "step-00000001" and chosen.ok
    assert [(f.path, f.reason) for f in passed] == [(newest, alone.reason)]
    verifier.done()
