"""Prepared datasets are verified at load; each rank reads its own shard in a resumable order."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from trainwatch.errors import ConfigError
from trainwatch.trainer.data import (ShardedBatches, ensure_default_dataset, generate_corpus,
                                     load_dataset, prepare_generated)


def test_corpus_is_deterministic_and_prepare_round_trips(tmp_path):
    assert generate_corpus(5000, seed=7) == generate_corpus(5000, seed=7)
    assert generate_corpus(5000, seed=7) != generate_corpus(5000, seed=8)
    manifest = prepare_generated(tmp_path / "d", size_bytes=20_000, seed=7, val_fraction=0.25)
    data = load_dataset(tmp_path / "d")
    assert len(data.train) == manifest["splits"]["train"]["tokens"] == 15_000
    assert len(data.val) == 5_000
    assert bytes(data.train[:50]) + bytes(data.val[:0]) == generate_corpus(20_000, 7)[:50]


def test_checksum_mismatch_and_missing_corpus_are_config_errors(tmp_path):
    prepare_generated(tmp_path / "d", size_bytes=20_000, seed=7, val_fraction=0.1)
    train_bin = tmp_path / "d" / "train.bin"
    raw = bytearray(train_bin.read_bytes())
    raw[100] ^= 0xFF  # same size, different content
    train_bin.write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match="sha256 .* does not match") as info:
        load_dataset(tmp_path / "d")
    assert info.value.file == str(train_bin)
    with pytest.raises(ConfigError, match="manifest.json missing"):
        load_dataset(tmp_path / "nothing-here")


def test_data_cli_prepare_and_info_exit_codes(tmp_path):
    out = tmp_path / "d"
    cli = [sys.executable, "-m", "trainwatch"]
    prepared = subprocess.run([*cli, "data", "prepare", "--out", str(out), "--bytes", "20000"],
                              capture_output=True, text=True, timeout=60)
    assert prepared.returncode == 0, prepared.stderr
    info = subprocess.run([*cli, "data", "info", str(out), "--json"], capture_output=True,
                          text=True, timeout=60)
    assert info.returncode == 0 and '"verified": true' in info.stdout
    (out / "val.bin").write_bytes(b"x" * 2000)  # right size, wrong bytes
    bad = subprocess.run([*cli, "data", "info", str(out)], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2
    assert "val.bin" in bad.stderr and "does not match the manifest" in bad.stderr


def labelled_tokens(windows, context=8):
    """Tokens where every token of window w is w, so a batch row says which window it is."""
    return np.append(np.repeat(np.arange(windows), context), 0).astype(np.uint8)


def windows_of(loader, batches):
    return [int(x[row, 0]) for x, _ in (next(loader) for _ in range(batches))
            for row in range(x.shape[0])]


def make(tokens, rank, world_size=3, seed=5, batch_size=4, context=8):
    return ShardedBatches(tokens, context=context, batch_size=batch_size, rank=rank,
                          world_size=world_size, seed=seed)


def test_ranks_read_disjoint_shards_in_a_seeded_order():
    tokens = labelled_tokens(250)
    loaders = [make(tokens, rank) for rank in range(3)]
    per_epoch = loaders[0].batches_per_epoch
    shards = [windows_of(loader, per_epoch) for loader in loaders]
    assert all(len(s) == len(set(s)) for s in shards)
    assert not set(shards[0]) & set(shards[1]) and not set(shards[1]) & set(shards[2])
    assert len(set().union(*shards)) == 3 * per_epoch * 4
    assert shards[0] == windows_of(make(tokens, 0), per_epoch)  # deterministic
    assert shards[0] != windows_of(make(tokens, 0, seed=6), per_epoch)
    x, y = next(make(tokens, 0))
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    assert windows_of(make(tokens, 0), per_epoch + 1)[-4:] != shards[0][:4]  # epoch 1 reshuffles


def test_resume_mid_epoch_yields_exactly_the_remaining_batches():
    tokens = labelled_tokens(200)
    original = make(tokens, rank=1, world_size=2)
    per_epoch = original.batches_per_epoch
    for _ in range(per_epoch - 3):  # stop three batches before the epoch ends
        next(original)
    saved = original.state_dict()
    expected = [next(original) for _ in range(8)]  # crosses into the next epoch
    resumed = make(tokens, rank=1, world_size=2)
    resumed.load_state_dict(saved)
    got = [next(resumed) for _ in range(8)]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(expected, got))
    assert resumed.state_dict() == original.state_dict() and resumed.epoch == 1
    with pytest.raises(ConfigError, match="seed=5, this run has 6") as info:
        make(tokens, rank=0, world_size=2, seed=6).load_state_dict(saved)
    assert info.value.key == "data.shuffle_seed"


def test_the_job_reads_the_epoch_order_front_to_back_rank_r_every_r_th_window():
    """What checkpoints written before ``consumed`` rely on: at one world size the loader
    takes exactly the windows it always took (rank r's p-th batch: its share of the order,
    r::world, cut in batches), so their positions continue unchanged."""
    tokens = labelled_tokens(250)
    order = np.random.default_rng([5, 0]).permutation(250)
    share = order[1::3][:250 // 3]
    assert windows_of(make(tokens, rank=1), 5) == share[:20].tolist()
    job = [make(tokens, rank) for rank in range(3)]
    calls = [[windows_of(loader, 1) for loader in job] for _ in range(4)]
    assert [w for call in calls for w in np.array(call).T.ravel().tolist()] == \
        order[:48].tolist()  # batch by batch, the ranks interleaved: the order's prefix


def test_another_world_size_continues_from_the_windows_the_job_consumed():
    """A position saved by 2 ranks x batch 4 resumes at 3 ranks x batch 3 and at 1 rank x
    batch 8: the new job reads the rest of the epoch's order from exactly where the old one
    stopped, no window twice and none skipped; then the epoch ends by the new batch's rule
    (fewer windows left than one call takes: dropped) and the next epoch is the same order
    as ever."""
    tokens = labelled_tokens(250)
    order = np.random.default_rng([5, 0]).permutation(250).tolist()
    old = [make(tokens, rank, world_size=2) for rank in range(2)]
    before = [windows_of(loader, 5) for loader in old]
    assert sorted(before[0] + before[1]) == sorted(order[:40])
    saved = old[0].state_dict()
    assert saved["consumed"] == 40 and saved["position"] == 5 and saved == old[1].state_dict()

    new = [make(tokens, rank, world_size=3, batch_size=3) for rank in range(3)]
    for loader in new:
        loader.load_state_dict(saved)
    calls = [[windows_of(loader, 1) for loader in new] for _ in range(23)]  # 207 windows
    read = [w for call in calls for w in np.array(call).T.ravel().tolist()]
    assert read == order[40:247]
    assert new[0].state_dict()["consumed"] == 247 and new[0].position == 27
    following = np.random.default_rng([5, 1]).permutation(250).tolist()
    assert windows_of(new[1], 1) == following[1:9:3]  # 3 left: dropped, epoch 1 begins
    assert new[1].epoch == 1 and new[1].consumed == 9

    alone = make(tokens, 0, world_size=1, batch_size=8)
    alone.load_state_dict(saved)
    assert windows_of(alone, 2) == order[40:56]
    # a position saved before ``consumed`` was recorded: batches x its batch x its world
    legacy = {"epoch": 0, "position": 5, "seed": 5, "world_size": 2, "batch_size": 4}
    alone.load_state_dict(legacy)
    assert windows_of(alone, 1) == order[40:48]


def test_default_dataset_is_prepared_once_and_reused(tmp_path):
    out = ensure_default_dataset(tmp_path / "data", size_bytes=10_000, seed=1, val_fraction=0.1)
    mtime = (out / "manifest.json").stat().st_mtime_ns
    ensure_default_dataset(out, size_bytes=10_000, seed=1, val_fraction=0.1)
    assert (out / "manifest.json").stat().st_mtime_ns == mtime
    ensure_default_dataset(out, size_bytes=12_000, seed=1, val_fraction=0.1)
    assert len(load_dataset(out).train) == 10_800


def test_too_little_data_is_a_clear_error():
    with pytest.raises(ConfigError, match="too few"):
        make(np.zeros(20, dtype=np.uint8), rank=0)
