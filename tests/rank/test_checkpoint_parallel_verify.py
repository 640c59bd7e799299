"""Every rank hashes its share of a checkpoint at resume; rank 0 hears the verdict.

Before: rank 0 alone hashed every rank's files while the others waited (a third of a
sharded resume, docs/benchmarks.md). Now each rank is sent its own files and a fair share
of the rest, and the verdict (and so the fallback past a bad file) is the one a single
rank hashing everything reaches. Here one real gloo rank; the 2-rank fallback runs in
test_checkpoint_sharded_e2e.py."""

import torch

from trainwatch import Checkpoints
from trainwatch.rank.checkpoint import resume as resume_mod
from checkpoint_helpers import two_saved_steps
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


def _two_ranks(monkeypatch, theirs):
    """Rank 0's or 1's side of a 2-rank job: ``theirs(mine, call)`` is what the other rank
    sends to gather number ``call``; every broadcast is recorded, none is sent."""
    calls, sent = [], []

    def gather(_verifier, mine):
        calls.append(mine)
        return theirs(mine, len(calls))

    monkeypatch.setattr(ParallelVerify, "_gather", gather)
    monkeypatch.setattr(torch.distributed, "broadcast_object_list",
                        lambda box, src, group: sent.append(list(box)))
    return calls, sent


def test_the_first_candidate_needs_no_broadcast_when_every_rank_read_its_manifest(
        tmp_path, monkeypatch):
    from trainwatch.rank.checkpoint.early_digests import EarlyDigests

    folder, newest = two_saved_steps(tmp_path)
    calls, sent = _two_ranks(monkeypatch, lambda mine, n: [mine, ([], ([], None), mine[2],
                                                                   None)])
    verifier = ParallelVerify(0, 2, "gloo", early=EarlyDigests.start(folder, 0, 2))
    chosen, passed = resume_mod.select([folder], verifier.verify)
    assert chosen is not None and chosen.path == newest and chosen.ok and not passed
    assert sent == [] and len(calls) == 1 and calls[0][2][0] == str(newest)
    assert verifier.decision is not None and verifier.decision["path"] == str(newest)
    verifier.done()
    assert sent == [] and "rank-00000.pt" in verifier.take(newest)


def test_a_rank_that_read_another_manifest_gets_it_sent_and_the_round_is_redone(
        tmp_path, monkeypatch):
    folder, newest = two_saved_steps(tmp_path)

    def theirs(mine, call):  # rank 1 read nothing at first; then hashes what it is sent
        return [mine, ([], ([], None), None, None) if call == 1 else ([], ([], None))]

    calls, sent = _two_ranks(monkeypatch, theirs)
    verifier = ParallelVerify(0, 2, "gloo")
    chosen, _ = resume_mod.select([folder], verifier.verify)
    assert chosen is not None and chosen.path == newest and chosen.ok
    assert len(calls) == 2 and [box[0] for box in sent] == [str(newest)]
    assert sent[0][1] == chosen.manifest


def test_the_other_ranks_hash_the_newest_and_hear_the_decision_in_the_first_gather(
        tmp_path, monkeypatch):
    from trainwatch.rank.checkpoint.early_digests import EarlyDigests

    folder, newest = two_saved_steps(tmp_path)
    decision = {"path": str(newest), "told": None}
    calls, sent = _two_ranks(monkeypatch, lambda mine, n: [([], ([], decision), mine[2],
                                                            None), mine])
    rank1 = ParallelVerify(1, 2, "gloo", early=EarlyDigests.start(folder, 1, 2))
    got = rank1.serve()
    assert got["path"] == str(newest) and got["manifest"]["step"] == 2 and sent == []
    assert calls[0][2][0] == str(newest) and calls[0][0] == []  # its share was clean

    calls, sent = _two_ranks(monkeypatch, lambda mine, n: [(None, None, None, {}), mine])
    fresh = ParallelVerify(1, 2, "gloo", early=EarlyDigests.start(tmp_path / "none", 1, 2))
    assert fresh.serve() == {} and sent == []  # rank 0 found none: told in that gather
