"""In-memory snapshots (trainwatch/rank/memory_snapshots/): the store's sealing and
checks, the agreement rule, the cadence, and a resume of an own loop from memory."""

import hashlib
import json
import os
import stat
import time

import pytest
import torch
import xxhash

from conftest import tmpfs_mount
from trainwatch.rank.checkpoint import Checkpoints
from trainwatch.rank.memory_snapshots import store
from trainwatch.rank.memory_snapshots.agree import Found, newest_common
from trainwatch.rank.memory_snapshots.cadence import Cadence
from trainwatch.rundir.run_dir import RunDir


def _seal(folder, step, data=b"x" * 1000, rank=0):
    return store.seal(folder, rank=rank, step=step, world_size=1, config_hash=None,
                      write=lambda f: f.write(data))


class Died(BaseException):
    """The writer's process died mid-write (what SIGKILL leaves is a partial temp file)."""


# --------------------------------------------------------------------------- store

def test_a_write_that_dies_midway_leaves_the_previous_snapshot_whole(tmp_path):
    folder = store.make_folder(tmp_path / "root" / "rank-00000")
    first = _seal(folder, 1)

    def dies(f):
        f.write(b"y" * 500)
        raise Died()

    with pytest.raises(Died):
        store.seal(folder, rank=0, step=2, world_size=1, config_hash=None, write=dies)
    assert [s.step for s in store.sealed(folder)] == [1]
    assert store.verify(first.path).digest == first.digest
    # A SIGKILLed writer (another pid) leaves its temp file; it is never listed, and the
    # next writer's retention removes it.
    torn = folder / f"{store.TMP_PREFIX}{store.snapshot_name(2)}.999999"
    torn.write_bytes(b"TWSNAP01 partial")
    assert [s.step for s in store.sealed(folder)] == [1]
    assert store.retain(folder, {1}) == [torn] and not torn.exists()
    assert first.path.exists()


def test_files_are_private_and_a_truncated_or_altered_one_is_rejected(tmp_path):
    folder = store.make_folder(tmp_path / "root" / "rank-00000")
    snap = _seal(folder, 3)
    assert stat.S_IMODE(os.stat(snap.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(folder.parent).st_mode) == 0o700
    data = bytearray(snap.path.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit of the payload
    snap.path.write_bytes(bytes(data))
    with pytest.raises(store.Rejected, match="digest mismatch"):
        store.verify(snap.path)
    snap.path.write_bytes(bytes(data[:-10]))
    with pytest.raises(store.Rejected, match="torn"):
        store.verify(snap.path)
    assert store.sealed(folder) == []


def test_the_payload_digest_is_xxh3_and_a_sha256_snapshot_of_version_1_still_verifies(tmp_path):
    """sha256 of the payload cost the writer as much CPU as serializing the state (300 MB:
    ~0.24 s of ~0.47 s on the 2-core VM, docs/benchmarks.md); xxh3-128 hashes at memory
    speed. A file of version 1 (sha256, no algorithm named) left in /dev/shm by the code
    before still verifies; an algorithm nobody knows is rejected by name."""
    folder = store.make_folder(tmp_path / "root" / "rank-00000")
    data = os.urandom(4096)
    snap = _seal(folder, 3, data)
    header = store.read_header(snap.path)
    assert header["digest_algorithm"] == "xxh3_128" and header["version"] == store.VERSION
    assert snap.digest == xxhash.xxh3_128(data).hexdigest()
    assert store.verify(snap.path).digest == snap.digest

    def rewrite(**changes):
        text = store.MAGIC + json.dumps({**header, **changes}).encode()
        old = snap.path.read_bytes()
        snap.path.write_bytes(text.ljust(store.HEADER_BYTES, b" ") + old[store.HEADER_BYTES:])

    header.pop("digest_algorithm")
    rewrite(version=1, digest=hashlib.sha256(data).hexdigest())
    assert store.verify(snap.path).digest == hashlib.sha256(data).hexdigest()
    rewrite(digest_algorithm="md4")
    with pytest.raises(store.Rejected, match="unknown digest algorithm 'md4'"):
        store.verify(snap.path)


def test_links_special_files_and_strangers_in_the_folder_are_skipped(tmp_path):
    folder = store.make_folder(tmp_path / "root" / "rank-00000")
    good = _seal(folder, 5)
    (folder / store.snapshot_name(9)).symlink_to(good.path)
    os.mkfifo(folder / store.snapshot_name(10))  # a read would block: never opened
    (folder / store.snapshot_name(11)).write_bytes(b"not a snapshot")
    (folder / "notes.txt").write_text("hi")
    assert [(s.rank, s.step, s.path) for s in store.sealed(folder)] == [(0, 5, good.path)]
    with pytest.raises(store.Rejected, match="not a plain file"):
        store.verify(folder / store.snapshot_name(9))
    # retention removes snapshot-named links and files, never follows a link
    store.retain(folder, set())
    assert good.path.exists() is False and (folder / "notes.txt").exists()
    assert (folder / store.snapshot_name(10)).exists()  # a FIFO is not ours to remove


def test_a_folder_owned_by_another_user_or_a_link_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "root").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PermissionError, match="not a plain folder"):
        store.make_folder(tmp_path / "root" / "rank-00000")
    other = tmp_path / "theirs"
    other.mkdir()
    os.chown(other, 12345, 12345)
    with pytest.raises(PermissionError, match="owned by uid 12345"):
        store.make_folder(other / "rank-00000")


def test_no_shm_is_a_named_reason(tmp_path):
    root, why = store.default_root(tmp_path / "run", shm=tmp_path / "no-shm")
    assert root is None and why == f"{tmp_path / 'no-shm'} is absent (no tmpfs to keep " \
        "snapshots in)"
    root, why = store.default_root(tmp_path / "run", shm=tmp_path)
    assert why is None and root.parent == tmp_path / f"trainwatch-{os.geteuid()}"
    assert root.name.startswith("run-") and root == store.default_root(
        tmp_path / "run", shm=tmp_path)[0]


def test_snapshots_of_a_run_directory_that_is_gone_are_swept(tmp_path):
    parent = tmp_path / "shm"
    live, dead, stranger = parent / "live-1", parent / "dead-2", parent / "other"
    for root in (live, dead, stranger):
        store.make_folder(root / "rank-00000")
    (tmp_path / "run").mkdir()
    store.claim(live, tmp_path / "run")
    store.claim(dead, tmp_path / "deleted-run")
    assert store.sweep(parent) == [dead]
    assert live.exists() and stranger.exists() and not dead.exists()


def test_the_sweep_runs_aside_on_the_nodes_first_rank_only(tmp_path, monkeypatch):
    parent = tmp_path / "shm"
    dead = parent / "dead-2"
    store.make_folder(dead / "rank-00000")
    store.claim(dead, tmp_path / "deleted-run")
    monkeypatch.setenv("LOCAL_RANK", "1")  # its node's first rank sweeps
    assert store.sweep_aside(parent) is None and dead.exists()
    monkeypatch.setenv("LOCAL_RANK", "0")
    thread = store.sweep_aside(parent)
    assert thread is not None and thread.daemon
    thread.join(timeout=10)
    assert not dead.exists()


# --------------------------------------------------------------------------- agree, cadence

def test_the_ranks_agree_on_the_newest_step_every_rank_has():
    ranks = [Found(0, {14: 1.0, 15: 2.0}, durable_step=10), Found(1, {14: 1.0})]
    assert newest_common(ranks).step == 14
    assert newest_common(ranks, frozenset({14})).reason == "rank 1 has none"
    apart = newest_common([Found(0, {15: 2.0}), Found(1, {14: 1.0})])
    assert apart.reason == "no step every rank has (newest per rank: 0: 15, 1: 14)"
    assert newest_common([Found(0, {15: 2.0}, durable_step=10), Found(1, {})]).reason == \
        "rank 1 has none"
    late = newest_common([Found(0, {10: 1.0}, durable_step=10)])
    assert late.step is None and "not newer than the durable checkpoint (step 10)" in late.reason
    assert newest_common([Found(0, {3: 1.0})]).step == 3  # no durable checkpoint at all
    rolled = newest_common([Found(0, {15: 1.0}, rollback_at=5.0), Found(1, {15: 1.0})])
    assert rolled.step is None and rolled.reason == "every snapshot predates the last rollback"
    after = [Found(0, {15: 1.0, 17: 9.0}, rollback_at=5.0), Found(1, {15: 1.0, 17: 9.0})]
    assert newest_common(after).step == 17


def test_the_cadence_is_every_step_or_the_smallest_k_within_one_percent():
    pinned = Cadence("every_step")
    pinned.note(0.010, 1, 0.050)
    assert pinned.every() == 1 and pinned.why(1).startswith("every step (memory_snapshots")
    auto = Cadence("auto")
    assert auto.every() == 1  # nothing measured yet
    for _ in range(5):
        auto.note(0.002, 1, 0.050)  # 2 ms of a 50 ms step: 4 % at K=1
    assert auto.every() == 4
    assert auto.why(4) == ("every 4 steps: the smallest K keeping the cost within 1 % of step "
                           "time (measured cost 1.00% of step time: the loop's wait 2.0 ms, "
                           "the writer's GIL 0.0 ms a snapshot)")
    cheap = Cadence("auto")
    cheap.note(0.0001, 1, 1.0)
    assert cheap.every() == 1 and cheap.why(1).startswith("every step: its cost is within")
    # K at or past the durable interval: said, not snapshotted silently
    slow = Cadence("auto", durable_every=10)
    slow.note(0.001, 1, 0.060, writer_seconds=0.001)  # 2 ms of a 50 ms step: K = 4
    assert slow.every() == 4 and slow.verdict(4) == "every_k"
    slow.note(0.004, 1, 0.051, writer_seconds=0.001)
    slow.note(0.004, 1, 0.051, writer_seconds=0.001)  # 5 ms a snapshot: K = 10
    assert slow.every() == 10 and slow.verdict(10) == "not_below_durable"
    assert "not below the durable checkpoint's interval (10 steps)" in slow.why(10)


# --------------------------------------------------------------------------- an own loop

def _loop(run, shm, steps, start_state=None, **settings):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpoints.from_env(run, every_steps=10, fsync=False, memory_snapshots="every_step",
                                memory_snapshots_dir=str(shm), **settings)
    start = ckpt.resume(model=model, optimizer=opt)
    for step in range(start, steps):
        model(torch.randn(2, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ckpt.maybe_save(step + 1, model=model, optimizer=opt)
    ckpt.checkpointer.memory.wait()
    ckpt.wait()  # the durable save of step 10 is async: sealed before the next start scans
    return ckpt, start, model


def test_an_own_loop_resumes_from_memory_losing_nothing_and_a_rollback_is_respected(tmp_path):
    run, shm = tmp_path / "run", tmp_path / "shm"
    shm.mkdir()
    crashed, _, model = _loop(run, shm, 13)  # no close: the process "died" after step 13
    weights, rng_next = model.weight.detach().clone(), torch.rand(1)
    folder = crashed.checkpointer.memory.folder
    assert [s.step for s in store.sealed(folder)] == [13, 12]  # two slots
    peers = crashed.checkpointer.memory.facts["peer_copies"]  # one node: the local path
    assert peers == {"enabled": False, "off_reason": "one node: no peer copies (every rank is "
                     "on the same node, so a node loss falls back to the durable checkpoint)"}
    again, start, model = _loop(run, shm, 13)
    assert start == 13 and torch.equal(model.weight, weights)
    assert torch.equal(torch.rand(1), rng_next)  # the RNGs continue where they were
    (resumed,) = RunDir(run).events("checkpoint_resumed")
    assert resumed["state_from"] == "memory snapshot" and resumed["step"] == 13
    assert resumed["durable_step"] == 10 and resumed["steps_kept"] == 3
    # A rollback after the snapshots: they hold what it rolls back from, so not used.
    RunDir(run).append_event("action_taken", "engine", action="rollback_skip")
    _, start, _ = _loop(run, shm, 13)
    assert start == 10
    last = RunDir(run).events("checkpoint_resumed")[-1]
    assert last["state_from"] == "checkpoint" and last["memory_snapshot"] == \
        "every snapshot predates the last rollback"
    again.close()  # the run finished: its snapshots are freed
    assert not folder.exists() and not folder.parent.exists()


def test_the_writers_gil_time_counts_in_the_cadence(tmp_path, monkeypatch):
    """Before: ``auto`` sized K by the loop's wait alone, not the writer thread's time
    holding the GIL (then all of ``torch.save``'s: x1.77 step time at the reference model,
    docs/benchmarks.md), so its K kept a cost it did not see."""
    from trainwatch.rank.memory_snapshots import payload

    real = payload.index

    def slow(tree, host):  # 50 ms of the writer's CPU holding the GIL
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
        return real(tree, host)

    monkeypatch.setattr(payload, "index", slow)
    ckpt, _, _ = _loop(tmp_path / "run", tmp_path, 3)
    memory = ckpt.checkpointer.memory
    assert memory.facts["taken_total"] == 3 and memory.facts["writer_gil_seconds"] >= 0.05
    assert memory.cadence.cost() >= 0.05 and "the writer's GIL" in memory.facts["cadence"]


def test_an_altered_snapshot_is_rejected_and_the_one_before_is_used(tmp_path):
    run, shm = tmp_path / "run", tmp_path / "shm"
    shm.mkdir()
    crashed, _, _ = _loop(run, shm, 13)
    newest = store.sealed(crashed.checkpointer.memory.folder)[0]
    data = bytearray(newest.path.read_bytes())
    data[-1] ^= 0xFF
    newest.path.write_bytes(bytes(data))
    _, start, _ = _loop(run, shm, 12)
    assert start == 12
    (rejected,) = RunDir(run).events("memory_snapshot_rejected")
    assert rejected["step"] == 13 and "digest mismatch" in rejected["ranks"]["0"]


def test_a_full_tmpfs_skips_snapshots_counts_them_and_training_goes_on(tmp_path):
    with tmpfs_mount(tmp_path / "shm", "1m") as shm:
        torch.manual_seed(0)
        model = torch.nn.Linear(400, 400)  # 0.6 MB: one snapshot fits, two do not
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ckpt = Checkpoints.from_env(tmp_path / "run", every_steps=0, fsync=False,
                                    memory_snapshots="every_step",
                                    memory_snapshots_dir=str(shm))
        for step in range(4):
            model(torch.randn(2, 400)).square().mean().backward()
            opt.step()
            ckpt.maybe_save(step + 1, model=model, optimizer=opt)
        ckpt.checkpointer.memory.wait()
        facts = ckpt.checkpointer.memory.facts
        assert facts["taken_total"] >= 1 and facts["skipped_full_total"] >= 1
        assert facts["failed_total"] == 0
        folder = ckpt.checkpointer.memory.folder
        assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []
        skipped = RunDir(tmp_path / "run").events("memory_snapshot_skipped")
        assert len(skipped) == 1 and skipped[0]["kind"] == "full"  # the first, journaled
        status = json.loads(RunDir(tmp_path / "run").status_file(0).read_text()) \
            if RunDir(tmp_path / "run").status_file(0).exists() else None
        assert status is None or "memory_snapshots" in status["checkpoint"]
        ckpt.close()


def test_a_memory_snapshot_of_the_last_step_does_not_replace_the_final_save(tmp_path):
    """Before: ``maybe_save`` counted a memory snapshot as a save, so ``close()`` skipped
    the final checkpoint of a step the snapshots had taken, and then freed the snapshots:
    the run's last steps were in no checkpoint."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpoints.from_env(tmp_path / "run", every_steps=100, fsync=False,
                                memory_snapshots="every_step",
                                memory_snapshots_dir=str(tmp_path))
    for step in range(3):
        model(torch.randn(2, 8)).square().mean().backward()
        opt.step()
        assert not ckpt.maybe_save(step + 1, model=model, optimizer=opt)
    ckpt.close()
    assert [e["step"] for e in RunDir(tmp_path / "run").events("checkpoint_saved")] == [3]


def test_a_step_saved_durably_is_not_also_snapshotted(tmp_path):
    """Before: step 10 was copied twice, into the durable save and into a snapshot; now the
    save's copy serves (it is what a resume uses: a snapshot must be newer than it)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    ckpt, _, _ = _loop(tmp_path / "run", shm, 11)  # every_steps=10
    memory = ckpt.checkpointer.memory
    assert [s.step for s in store.sealed(memory.folder)] == [11, 9]
    assert memory.facts["taken_total"] == 10 and memory.facts["durable_skipped_total"] == 1
    assert [e["step"] for e in RunDir(tmp_path / "run").events("checkpoint_saved")] == [10]
    ckpt.close()
