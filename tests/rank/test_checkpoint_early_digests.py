"""A rank's own shard is hashed from the start of resume, and only a digest of the very
file rank 0 asks about is used.

Before: each rank began hashing its ``__<rank>_0.distcp`` only when rank 0's request came,
after the ranks had agreed on memory snapshots and rank 0 had listed the checkpoints.
Now a helper thread hashes it from the start (early_digests.py); the verdict must stay the
one hashing at request time gives: a file changed after it was hashed early, another
directory, or a shard corrupted before resume are all judged as ``check_file`` judges
them."""

import os

from checkpoint_helpers import two_saved_steps
from trainwatch.checkpoint_format.manifest import DIGEST, check_file, digest_file
from trainwatch.rank.checkpoint.early_digests import EarlyDigests, newest_step_dir
from trainwatch.rank.checkpoint.parallel_verify import check_share


def _checkpoint(folder, step, data):
    directory = folder / f"step-{step:08d}"
    directory.mkdir(parents=True)
    (directory / "__1_0.distcp").write_bytes(data)
    return directory, {"__1_0.distcp": {DIGEST: digest_file(directory / "__1_0.distcp"),
                                        "bytes": len(data)}}


def test_the_newest_shard_is_hashed_early_and_its_digest_used_while_unchanged(tmp_path):
    _checkpoint(tmp_path, 2, os.urandom(3 << 20))
    newest, files = _checkpoint(tmp_path, 10, os.urandom(3 << 20))
    assert newest_step_dir(tmp_path) == newest  # by number, not by name's order
    early = EarlyDigests.start(tmp_path, 1)
    assert early.digest(newest, "__1_0.distcp") == files["__1_0.distcp"][DIGEST]
    assert early.digest(tmp_path / "step-00000002", "__1_0.distcp") is None  # not hashed
    assert early.digest(newest, "__0_0.distcp") is None
    assert check_share(newest, files, early=early) == []
    assert EarlyDigests.start(tmp_path, 0).digest(newest, "__0_0.distcp") is None  # none


def test_a_shard_changed_after_it_was_hashed_early_is_hashed_again(tmp_path):
    newest, files = _checkpoint(tmp_path, 4, os.urandom(1 << 20))
    early = EarlyDigests.start(tmp_path, 1)
    assert early.digest(newest, "__1_0.distcp") is not None
    shard = newest / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[7] ^= 1
    shard.write_bytes(bytes(data))  # same size, same second, maybe: the ctime still moves
    os.utime(shard, ns=(1, 1))
    assert early.digest(newest, "__1_0.distcp") is None
    assert check_share(newest, files, early=early) == [check_file(newest, "__1_0.distcp",
                                                                  files["__1_0.distcp"])[1]]
    assert "xxh3_128 mismatch" in check_share(newest, files, early=early)[0]


def test_a_shard_corrupt_before_resume_fails_as_check_file_says(tmp_path):
    newest, files = _checkpoint(tmp_path, 4, os.urandom(1 << 20))
    shard = newest / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    early = EarlyDigests.start(tmp_path, 1)
    problems = check_share(newest, files, early=early)
    assert early.digest(newest, "__1_0.distcp") is not None  # hashed early: the bad digest
    assert problems == ["__1_0.distcp: xxh3_128 mismatch (content changed or corrupt)"]
    files["__1_0.distcp"]["bytes"] += 1  # and the size is still checked first
    assert check_share(newest, files, early=early) == [
        check_file(newest, "__1_0.distcp", files["__1_0.distcp"])[1]]


def test_stopped_before_it_finished_it_serves_nothing(tmp_path):
    newest, files = _checkpoint(tmp_path, 4, os.urandom(8 << 20))
    early = EarlyDigests(newest, ["__1_0.distcp"])
    early.stop()
    early._hash_all()  # stopped: returns at once
    assert early.digest(newest, "__1_0.distcp") is None
    assert check_share(newest, files, early=early) == []


def test_the_manifest_and_the_own_rank_file_are_read_early_and_handed_over_once(tmp_path):
    import torch

    from trainwatch.checkpoint_format.manifest import read_manifest

    folder, newest = two_saved_steps(tmp_path)
    early = EarlyDigests.start(folder, 0, 1)
    manifest = read_manifest(newest)
    assert early.guess() == (newest, manifest)
    entry = manifest["files"]["rank-00000.pt"]
    assert early.value(newest, "rank-00000.pt", {**entry, "bytes": 1}) == (False, None)
    found, value = early.value(newest, "rank-00000.pt", entry)
    assert not found  # the entry differed: dropped, never handed over for another
    early = EarlyDigests.start(folder, 0, 1)
    found, value = early.value(newest, "rank-00000.pt", entry)
    plain = torch.load(newest / "rank-00000.pt", weights_only=True)
    assert found and value["rank"] == plain["rank"] and torch.equal(
        value["rng"]["torch"], plain["rng"]["torch"])
    assert early.value(newest, "rank-00000.pt", entry) == (False, None)  # once
    assert early.value(folder / "step-00000001", "rank-00000.pt", entry) == (False, None)
    loaded = {}
    early = EarlyDigests.start(folder, 0, 1)
    assert check_share(newest, {"rank-00000.pt": entry}, {"rank-00000.pt"}, loaded,
                       early) == [] and loaded["rank-00000.pt"]["rank"] == 0
    assert EarlyDigests.start(folder, 0).guess() is None  # no world size: the shard alone


def test_a_corrupt_rank_file_is_not_loaded_early_and_fails_as_check_file_says(tmp_path):
    from trainwatch.checkpoint_format.manifest import read_manifest

    folder, newest = two_saved_steps(tmp_path)
    entry = read_manifest(newest)["files"]["rank-00000.pt"]
    data = bytearray((newest / "rank-00000.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (newest / "rank-00000.pt").write_bytes(bytes(data))
    early = EarlyDigests.start(folder, 0, 1)
    assert early.guess() is not None and early.loaded == {}
    loaded = {}
    assert check_share(newest, {"rank-00000.pt": entry}, {"rank-00000.pt"}, loaded,
                       early) == ["rank-00000.pt: xxh3_128 mismatch (content changed or "
                                  "corrupt)"] and loaded == {}
