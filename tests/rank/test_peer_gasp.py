"""A job on several nodes resumes from the survivors' dying gasps (memory_snapshots/peer_gasp.py):
the resume of peer_resume.py run in-process by 4 rank threads on two "nodes", each node's
/dev/shm a folder of its own, with sealed snapshot, gasp and part files in the store's
format. The real single-node drill: tests/rank/test_checkpoint_resume.py."""

import shutil
import threading
from types import SimpleNamespace

import torch

from trainwatch.rank.memory_snapshots import peer_gasp, peer_resume, rank_parts, store
from trainwatch.rank.memory_snapshots.peer_store import PeerStore, SnapshotFile, sha256_of
from trainwatch.rank.memory_snapshots.dying_gasp import gasp_folder
from trainwatch.rank.memory_snapshots.gasp_resume import GASP, OWN, plan
from trainwatch.rank.memory_snapshots.agree import Found
from trainwatch.rundir.run_dir import RunDir

NODE_OF = [0, 0, 1, 1]   # ranks 0, 1 on node a; ranks 2, 3 on node b
WORLD = 4


def test_each_node_restores_a_gasp_step_only_from_its_own_ranks_files():
    """Rank 3 (node b) died in step 16 with its parts of 14 and 15; ranks 0 and 1 gasped
    step 15. Node b's rank 2 wrote no gasp: node b holds no whole step 15, and a rank
    cannot read node a's /dev/shm. With rank 2's gasp, each node uses its own replica."""
    found = [Found(0, steps={13: 1.0}, gasps={15: 3.0}, parts={14: 2.0, 15: 3.0}),
             Found(1, steps={13: 1.0}, gasps={15: 3.0}, parts={14: 2.0, 15: 3.0}),
             Found(2, steps={13: 1.0}, parts={14: 2.0, 15: 3.0}),
             Found(3, steps={13: 1.0}, parts={14: 2.0, 15: 3.0})]
    assert plan(found, frozenset(), 13, NODE_OF) is None
    found[2].gasps[15] = 3.0
    chosen = plan(found, frozenset(), 13, NODE_OF)
    assert chosen is not None and chosen.step == 15
    assert chosen.shared_from == [(0, GASP), (1, GASP), (2, GASP), (2, GASP)]
    assert chosen.from_part == [False, False, False, True]
    # a replica's own snapshot stands in on its node as well
    found[2].gasps.pop(15)
    found[2].steps[15] = 3.0
    chosen = plan(found, frozenset(), 13, NODE_OF)
    assert chosen is not None and chosen.shared_from[3] == (2, OWN)


def _seal(folder, rank, step, body):
    store.seal(store.make_folder(folder), rank=rank, step=step, world_size=WORLD,
               config_hash="c", write=lambda f: torch.save(body, f), version=store.TORCH_SAVED)


def _node_files(roots):
    """Snapshots of step 13 on every rank (every 4 steps), parts of 14 and 15; rank 3 died
    in step 16, ranks 0, 1, 2 gasped step 15 (each node's files in its own folder)."""
    for rank in range(WORLD):
        root = roots[NODE_OF[rank]]
        _seal(store.rank_folder(root, rank), rank, 13,
              {"step": 13, "shared": {"w": torch.tensor(13.0)}, "rank": {"data": (rank, 13)}})
        for step in (14, 15):
            _seal(rank_parts.parts_folder(root, rank), rank, step,
                  {"step": step, "rank": {"data": (rank, step)}})
        if rank != 3:
            _seal(gasp_folder(root, rank), rank, 15,
                  {"step": 15, "shared": {"w": torch.tensor(15.0)}, "rank": {"data": (rank, 15)}})


class _Threads:
    """The two collectives of peer copies, for rank threads of one process."""

    def __init__(self):
        self.barrier = threading.Barrier(WORLD, timeout=60)
        self.slots = [None] * WORLD

    def of(self, rank):
        def all_gather(obj):
            self.slots[rank] = obj
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out
        return SimpleNamespace(rank=rank, world_size=WORLD, all_gather=all_gather,
                               broadcast=lambda obj: all_gather(obj)[0])


def _resume_all(roots, run):
    threads, results, journaled = _Threads(), [None] * WORLD, []

    def rank_main(rank):
        copies = SimpleNamespace(
            collective=threads.of(rank), rank=rank, world_size=WORLD, node_of=NODE_OF,
            holding=[],
            node_names=["a", "a", "b", "b"], off_reason=None,
            settings=SimpleNamespace(fetch_timeout_s=5.0),
            held=SimpleNamespace(held_ranks=list), release_fetched=lambda: None,
            after_resume=lambda step: None)
        root = roots[NODE_OF[rank]]
        snaps = SimpleNamespace(
            prepare=lambda carry=None: None, enabled=True, root=root, rank=rank, world_size=WORLD,
            folder=store.rank_folder(root, rank), config_hash="c", group=None,
            peers=SimpleNamespace(active=True, copies=copies), resumed=lambda step: None,
            journal=lambda kind, **fields: journaled.append((kind, fields)))
        results[rank] = peer_resume.resume(snaps, RunDir(run), None)

    workers = [threading.Thread(target=rank_main, args=(r,)) for r in range(WORLD)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    return results, journaled


def test_a_multi_node_resume_takes_the_survivors_gasps_with_each_ranks_own_part(tmp_path):
    roots = [tmp_path / "shm-a", tmp_path / "shm-b"]
    _node_files(roots)
    results, journaled = _resume_all(roots, tmp_path / "run")
    steps = [r.step for r, _ in results]
    assert steps == [15] * WORLD  # before: 13, the snapshot every rank has (2 steps lost)
    restored = [r for r, _ in results]
    assert all(float(r.shared["w"]) == 15.0 for r in restored)
    assert [r.rank_state["data"] for r in restored] == [(r, 15) for r in range(WORLD)]
    assert restored[3].manifest["state_of_rank"] == 2   # node b's replica, not node a's
    assert {r.manifest["source"] for r in restored} == {"dying gasp"}
    assert restored[0].manifest["steps_lost"] == 0 and not journaled

    # node b's only gasp altered: step 15 is dropped on every rank (counted, journaled),
    # and the exchange resumes every rank from the snapshot of step 13
    path = gasp_folder(roots[1], 2) / store.snapshot_name(15)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    results, journaled = _resume_all(roots, tmp_path / "run")
    assert [r.step for r, _ in results] == [13] * WORLD
    ((kind, fields),) = journaled
    assert kind == "memory_snapshot_rejected" and fields["step"] == 15
    assert "digest mismatch" in fields["ranks"]["2"] and "digest mismatch" in fields["ranks"]["3"]


class _Link:
    """The peer link's resume transfers between rank threads: a pushed file is copied
    into the receiving rank's folder (the wire itself: tests/rank/test_peer_transport.py)."""

    def __init__(self, base):
        self.base, self.cond = base, threading.Condition()
        self.expected = {r: set() for r in range(WORLD)}
        self.arrived = {r: {} for r in range(WORLD)}

    def of(self, me, parts):
        def expect(rank, step, digest):
            self.expected[me].add(rank)

        def wait_fetched(timeout):
            with self.cond:
                self.cond.wait_for(lambda: set(self.arrived[me]) >= self.expected[me], timeout)
                return dict(self.arrived[me])

        def push(to, snap):
            target = self.base / f"fetched-{to}" / f"rank-{snap.rank}.snap"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(snap.path.read_bytes())
            with self.cond:
                self.arrived[to][snap.rank] = SimpleNamespace(snapshot=SimpleNamespace(path=target))
                self.cond.notify_all()
            return "stored"
        return SimpleNamespace(expect=expect, wait_fetched=wait_fetched, parts=parts), push


def test_a_node_whose_every_rank_died_resumes_from_the_other_nodes_gasp_and_held_parts(tmp_path):
    """Node b's ranks 2 and 3 both died in step 16 and node b came back empty: no gasp
    there, no parts. Ranks 0 and 1 gasped step 15 and hold ranks 2's and 3's parts of 14
    and 15 (sent every step). Before, node b had nothing newer than its peer's copies of
    step 13 (2 steps lost); now ranks 2 and 3 are sent rank 0's/1's gasp and their parts,
    and every rank resumes at 15 with its own RNGs and data position."""
    roots = [tmp_path / "shm-a", tmp_path / "shm-b"]
    roots[1].mkdir()
    holder = {2: 0, 3: 1}
    for rank in range(WORLD):
        if NODE_OF[rank] == 0:
            _seal(store.rank_folder(roots[0], rank), rank, 13,
                  {"step": 13, "shared": {"w": torch.tensor(13.0)}, "rank": {"data": (rank, 13)}})
            _seal(gasp_folder(roots[0], rank), rank, 15,
                  {"step": 15, "shared": {"w": torch.tensor(15.0)}, "rank": {"data": (rank, 15)}})
        for step in (14, 15):
            folder = rank_parts.parts_folder(roots[0] / "sent" if NODE_OF[rank] else roots[0], rank)
            _seal(folder, rank, step, {"step": step, "rank": {"data": (rank, step)}})
    held = PeerStore(roots[0] / "held-parts")
    for rank, _ in holder.items():
        for sealed in store.sealed(rank_parts.parts_folder(roots[0] / "sent", rank)):
            arriving = held.arriving_path(rank, sealed.step)
            shutil.copyfile(sealed.path, arriving)
            size, sha = sha256_of(arriving)
            held.commit(arriving, SnapshotFile(rank, sealed.step, WORLD, sealed.digest, arriving),
                        size, sha, rank)
    link, threads, results = _Link(tmp_path / "link"), _Threads(), [None] * WORLD

    def rank_main(rank):
        receiver, push = link.of(rank, held)
        copies = SimpleNamespace(
            collective=threads.of(rank), rank=rank, world_size=WORLD, node_of=NODE_OF,
            node_names=["a", "a", "b", "b"], off_reason=None, receiver=receiver, push=push,
            holding=[r for r, h in holder.items() if h == rank],
            settings=SimpleNamespace(fetch_timeout_s=10.0), held=SimpleNamespace(held_ranks=list),
            release_fetched=lambda: None, after_resume=lambda step: None)
        root = roots[NODE_OF[rank]]
        snaps = SimpleNamespace(
            prepare=lambda carry=None: None, enabled=True, root=root, rank=rank, world_size=WORLD,
            folder=store.rank_folder(root, rank), config_hash="c", group=None,
            peers=SimpleNamespace(active=True, copies=copies), resumed=lambda step: None,
            journal=lambda kind, **fields: None)
        results[rank] = peer_gasp.resume(snaps, copies, {"durable": None, "rollback_at": None},
                                         None)

    workers = [threading.Thread(target=rank_main, args=(r,)) for r in range(WORLD)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    restored = [r for r, _ in results]
    assert None not in restored, results
    assert [r.step for r in restored] == [15] * WORLD
    assert all(float(r.shared["w"]) == 15.0 for r in restored)
    assert [r.rank_state["data"] for r in restored] == [(r, 15) for r in range(WORLD)]
    assert restored[2].manifest["source"] == "dying gasp"
    assert restored[2].manifest["steps_lost"] == 0 and restored[2].manifest["transfers"] == 4
