"""A lost node's state is still in memory on another node, and a restart fetches it back:
4 real gloo ranks as 2 nodes (tests/jobs/peer_copies_job.py), node 1's ranks SIGKILLed."""

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent_helpers import REPO, stop_process, wait_for
from trainwatch.rank.memory_snapshots.peer_store import PeerStore

STEPS = 4


def gone(pid: int) -> bool:
    """Dead (reaped, or a zombie its launcher has yet to reap)."""
    try:
        return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True


def read(out: Path, name: str) -> dict:
    return json.loads((out / name).read_text())


@pytest.mark.slow
def test_a_lost_nodes_snapshots_are_held_by_the_other_node_and_fetched_back(tmp_path):
    root, out = tmp_path / "memory", tmp_path / "out"
    out.mkdir()
    log = open(tmp_path / "job.log", "wb")
    job = subprocess.Popen([sys.executable, "tests/jobs/peer_copies_job.py", str(root), str(out),
                            str(STEPS)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        wait_for(lambda: all((out / f"ready-{r}.json").exists() for r in range(4)) or job.poll(),
                 60, what="4 ranks with every copy of the last step stored")
        assert job.poll() is None, (tmp_path / "job.log").read_text()
        pids = [read(out, f"ready-{rank}.json")["pid"] for rank in (2, 3)]
        for pid in pids:                                     # node 1 is lost
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: all(gone(pid) for pid in pids), 30, what="node 1's ranks dead")
        (out / "node1-killed").touch()
        wait_for(lambda: all((out / f"after-{r}.json").exists() for r in (0, 1)), 60,
                 what="node 0's ranks past a step whose holders are dead")

        for rank in range(4):   # every step's copy stored, the first too: each receiver
            ready = read(out, f"ready-{rank}.json")   # knew what it holds before any was sent
            assert ready["stats"]["sender"]["counts"] == {"stored": STEPS}, ready

        # node 0 holds verified copies of ranks 2 and 3's newest step
        held = PeerStore(root / "node0" / "held")
        for rank in (2, 3):
            copy = held.newest(rank)
            assert copy is not None and copy.snapshot.step == STEPS
            assert held.verify(copy) == ""
            original = root / "node1" / "own" / f"r{rank}" / f"{STEPS:06d}.bin"
            assert copy.snapshot.path.read_bytes() == original.read_bytes()
            assert len(held.copies(rank)) == 2                 # bounded: the newest two
        assert stat.S_IMODE(os.stat(held.base).st_mode) == 0o700
        for rank in (0, 1):                                  # the dead holder cost no hang
            after = read(out, f"after-{rank}.json")
            assert after["offer_s"] < 0.1 and after["sent"], after
            assert after["stats"]["sender"]["counts"].get("failed") == 1, after

        shutil.rmtree(root / "node1")                        # the replacement node's memory
        begun = time.monotonic()
        (out / "restart").touch()
        wait_for(lambda: all((out / f"resumed-{r}.json").exists() for r in range(4))
                 or job.poll() is not None, 60, what="the restarted world's resume")
        restart_s = time.monotonic() - begun

        # then node 0 is lost for good: the job goes on with node 1's 2 ranks
        wait_for(lambda: held_by_node1_of(root, STEPS + 1) or job.poll() is not None, 60,
                 what="node 1 holding copies of the resumed history's step")
        shutil.rmtree(root / "node0")
        (out / "shrink").touch()
        assert job.wait(60) == 0, (tmp_path / "job.log").read_text()
    finally:
        stop_process(job, signal.SIGKILL)
        log.close()

    resumed = [read(out, f"resumed-{r}.json") for r in range(4)]
    assert [r["step"] for r in resumed] == [STEPS] * 4, resumed   # STEPS+1: only node 0 had it
    assert [r["source"] for r in resumed] == ["own", "own", "fetched", "fetched"]
    assert [r["from_rank"] for r in resumed[2:]] == [0, 1]      # their holders sent them
    assert [r["rank"] for r in resumed] == [0, 1, 2, 3] and all(r["whole"] for r in resumed)
    fetched = Path(resumed[2]["path"])
    assert fetched.is_relative_to(root / "node1") and stat.S_IMODE(fetched.stat().st_mode) == 0o600
    print(f"restart with fetch: {restart_s:.1f} s")

    # the shrunk world resumed from the copies of ranks 0, 1 its node held (world-size
    # rules for what old ranks 2, 3 carried: docs/checkpoints.md)
    shrunk = [read(out, f"shrunk-{r}.json") for r in range(2)]
    assert [(s["step"], s["rank"], s["source"], s["whole"]) for s in shrunk] == [
        (STEPS + 1, 0, "held", True), (STEPS + 1, 1, "held", True)], shrunk


def held_by_node1_of(root: Path, step: int) -> bool:
    held = PeerStore(root / "node1" / "held")
    return all((c := held.newest(r)) is not None and c.snapshot.step == step for r in (0, 1))
