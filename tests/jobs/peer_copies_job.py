"""Peer copies across two "nodes" of real gloo ranks, then a restart that fetches them back.

    python tests/jobs/peer_copies_job.py ROOT OUT STEPS

A launcher that, like torchrun, starts the ranks as processes with RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE=2, MASTER_ADDR/PORT and TRAINWATCH_NODE (node0, node1), each
"node" with its own memory folder ROOT/nodeN (its /dev/shm). Ranks are forked after torch is
imported once, to spare each its import on a busy CI machine. The test drives it with files
in OUT:

1. 4 ranks start peer copies and write a fake 1 MiB snapshot per step (the newest 2 kept,
   as the snapshotter's double buffer), offering each; once every copy of step STEPS is
   stored each writes OUT/ready-R.json (its pid) and node 1's ranks wait to be killed.
2. After OUT/node1-killed, node 0's ranks take step STEPS+1, offer it to their dead holders
   and write OUT/after-R.json (how long the sender took, its stats), then exit.
3. After OUT/restart (the test emptied ROOT/node1, as a replaced node's), 4 new ranks run
   the resume exchange over what is left, write OUT/resumed-R.json, then take step STEPS+1
   of the resumed history and see its copies stored.
4. After OUT/shrink (the test removed ROOT/node0: that node is lost for good), the job goes
   on with the 2 ranks of node 1 (elastic, --nnodes 1:2), renumbered 0 and 1: they resume
   from the copies of ranks 0 and 1 that node 1 holds and write OUT/shrunk-R.json.
"""

import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from trainwatch.contract.ports import LOOPBACK
from trainwatch.rank.memory_snapshots.peer_copies import PeerCopies, PeerSettings
from trainwatch.rank.memory_snapshots.peer_fetch import fetch_newest_common
from trainwatch.rank.memory_snapshots.peer_store import SnapshotFile

ROOT, OUT, STEPS = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
LOCAL = 2
WORLD = 4       # this launch's world size and each rank's node: set in the rank's process
NODES = [0, 0, 1, 1]
SETTINGS = PeerSettings(timeout_s=2.0, fetch_timeout_s=30.0)


def content(rank: int, step: int) -> bytes:
    return hashlib.sha256(f"{rank}/{step}".encode()).digest() * (1 << 15)   # 1 MiB


def node_root(rank: int) -> Path:
    return ROOT / f"node{NODES[rank]}"


def own_dir(rank: int) -> Path:
    return node_root(rank) / "own" / f"r{rank}"


def write_snapshot(rank: int, step: int) -> SnapshotFile:
    folder = own_dir(rank)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{step:06d}.bin"
    data = content(rank, step)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    for old in sorted(folder.glob("*.bin"))[:-2]:   # the newest two, as a double buffer
        old.unlink()
    return SnapshotFile(rank, step, WORLD, hashlib.sha256(data).hexdigest(), path)


def own_snapshots(rank: int) -> list[SnapshotFile]:
    found = []
    for path in sorted(own_dir(rank).glob("*.bin")):
        data = path.read_bytes()
        found.append(SnapshotFile(rank, int(path.stem), WORLD, hashlib.sha256(data).hexdigest(), path))
    return found


def dump(name: str, doc: dict) -> None:
    tmp = OUT / f".{name}"
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, OUT / name)


def wait_file(name: str) -> None:
    while not (OUT / name).exists():
        time.sleep(0.05)


def first(rank: int) -> None:
    copies = PeerCopies.start(node_root(rank), SETTINGS)
    for step in range(1, STEPS + 1):
        copies.offer(write_snapshot(rank, step))
        copies.sender.wait_sent(step, 30)
    dist.barrier()
    dump(f"ready-{rank}.json", {"pid": os.getpid(), "stats": copies.stats()})
    if rank >= LOCAL:
        while True:
            time.sleep(1)
    wait_file("node1-killed")
    begun = time.monotonic()
    copies.offer(write_snapshot(rank, STEPS + 1))
    offered = time.monotonic() - begun
    sent = copies.sender.wait_sent(STEPS + 1, 30)
    dump(f"after-{rank}.json", {"offer_s": offered, "sent": sent,
                                 "sender_s": time.monotonic() - begun, "stats": copies.stats()})
    copies.close()


def resume(rank: int, name: str) -> PeerCopies:
    copies = PeerCopies.start(node_root(rank), SETTINGS)
    outcome = fetch_newest_common(copies, own_snapshots(rank))
    resume = outcome.resume
    doc = {"reason": outcome.reason, "rejected": outcome.rejected, "transfers": outcome.transfers}
    if resume is not None:
        data = resume.snapshot.path.read_bytes()
        doc |= {"step": resume.step, "source": resume.source, "from_rank": resume.from_rank,
                "rank": resume.snapshot.rank, "path": str(resume.snapshot.path),
                "whole": data == content(resume.snapshot.rank, resume.step)}
    dump(f"{name}-{rank}.json", doc)
    return copies


def second(rank: int) -> None:
    copies = resume(rank, "resumed")
    copies.offer(write_snapshot(rank, STEPS + 1))   # the resumed history goes on
    assert copies.sender.wait_sent(STEPS + 1, 30), copies.stats()
    dist.barrier()                                  # every copy stored before a receiver goes
    copies.close()


def shrunk(rank: int) -> None:
    resume(rank, "shrunk").close()


def rank_main(rank: int, port: int, phase, nodes: list[int]) -> None:
    global WORLD, NODES
    WORLD, NODES = len(nodes), nodes
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank % LOCAL),
                      LOCAL_WORLD_SIZE=str(LOCAL), MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port),
                      TRAINWATCH_NODE=f"node{nodes[rank]}")
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    phase(rank)


def launch(phase, nodes: list[int]) -> list[int]:
    """Fork a rank per entry of ``nodes`` (its node); their exit statuses (-signal for a
    killed one)."""
    import socket

    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        port = s.getsockname()[1]
    pids = []
    for rank in range(len(nodes)):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                rank_main(rank, port, phase, nodes)
            except BaseException as exc:  # the test reads the job's output
                print(f"rank {rank}: {exc!r}", file=sys.stderr, flush=True)
                code = 1
            os._exit(code)   # no teardown against dead peers
        pids.append(pid)
    codes = []
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        codes.append(os.waitstatus_to_exitcode(status))
    return codes


if __name__ == "__main__":
    print("first:", launch(first, [0, 0, 1, 1]), flush=True)
    wait_file("restart")
    second_codes = launch(second, [0, 0, 1, 1])
    print("second:", second_codes, flush=True)
    wait_file("shrink")
    shrunk_codes = launch(shrunk, [1, 1])
    print("shrunk:", shrunk_codes, flush=True)
    sys.exit(0 if second_codes + shrunk_codes == [0] * 6 else 1)
