"""A lost node costs at most one step: real torchrun, two "nodes" (TRAINWATCH_NODE), the
own loop (examples/own_loop.py, the Checkpoints API) with the durable interval at 10.

One elastic torchrun per node (``--nnodes 1:2``, one rank each) meets at a rendezvous store
that neither node hosts. The node that runs rank 0 is lost: its launcher and rank are
SIGKILLed and its memory (its rank's snapshots, the copies it held) removed, as a lost
node's /dev/shm goes with it. The other node's torchrun goes on alone (2 ranks -> 1), and
its rank resumes from the copy of rank 0's snapshot its node held: the step the lost rank
had sealed, not the durable checkpoint up to 10 steps before it.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from torch.distributed import TCPStore

from agent_helpers import REPO, wait_for
from conftest import kill_tree  # SIGKILL ends a stopped process too: no SIGCONT first
from trainwatch.checkpoint_format import catalog
from trainwatch.contract.ports import LOOPBACK
from trainwatch.rank.memory_snapshots import store
from trainwatch.rank.memory_snapshots.peer_store import PeerStore
from trainwatch.rundir.run_dir import RunDir

NODES = ("node-a", "node-b")
DURABLE_EVERY = 10


def torchrun(node: str, port: int, run_dir: Path, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
           "--nproc-per-node", "1", "--max-restarts", "2", "--monitor-interval", "0.2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{LOOPBACK}:{port}",
           "--rdzv-id", "peer-resume", "--rdzv-conf",
           "is_host=0,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2",
           "examples/own_loop.py", "--steps", "100000", "--pace", "0.05",
           "--checkpoint-every", str(DURABLE_EVERY), "--memory-snapshots", "every_step"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRAINWATCH_NODE": node,
           "TRAINWATCH_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def worker(launcher: subprocess.Popen) -> psutil.Process | None:
    kids = [p for p in psutil.Process(launcher.pid).children(recursive=True)
            if "own_loop.py" in " ".join(p.cmdline())]
    return kids[0] if kids else None


def newest(folder: Path) -> int | None:
    sealed = store.sealed(folder)
    return sealed[0].step if sealed else None


def durable_step(run_dir: Path) -> int:
    """The newest complete durable checkpoint (what the resume compares snapshots with)."""
    return max((e.step for e in catalog.scan(run_dir / "checkpoints")
                if e.step is not None and e.state == "complete"), default=0)


def stopped(pid: int) -> bool:
    """Every thread of ``pid`` stopped (SIGSTOP is delivered asynchronously)."""
    tasks = Path(f"/proc/{pid}/task")
    return all((t / "stat").read_text().rsplit(")", 1)[1].split()[0] in "tT"
               for t in tasks.iterdir())


@pytest.mark.slow
def test_a_lost_node_resumes_from_its_peer_copy_losing_at_most_one_step(tmp_path):
    run_dir = tmp_path / "run"
    run = RunDir(run_dir)
    rendezvous = TCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False)
    log = open(tmp_path / "job.log", "wb")
    launchers = {node: torchrun(node, rendezvous.port, run_dir, log) for node in NODES}
    root = None
    try:
        def ready() -> bool:
            assert all(p.poll() is None for p in launchers.values()), \
                (tmp_path / "job.log").read_text()
            started = run.events("memory_snapshots_started")
            if not started or not run.events("checkpoint_saved"):
                return False
            held = PeerStore(Path(started[0]["root"]) / "held").newest(0)
            return held is not None and held.snapshot.step > DURABLE_EVERY
        wait_for(ready, 60, 0.1, "a durable checkpoint and a held copy of rank 0 newer")
        started = run.events("memory_snapshots_started")[0]
        root = Path(started["root"])
        assert started["peer_copies"] == "ring, offset 1, across 2 nodes", started
        workers = {node: worker(p) for node, p in launchers.items()}
        lost = next(n for n, w in workers.items() if w and w.environ()["RANK"] == "0")
        kept = next(n for n in NODES if n != lost)

        # The surviving launcher waits (its rank's collectives fail on their own) until
        # the lost node's memory is gone, so the restart cannot read it by chance.
        launchers[kept].send_signal(signal.SIGSTOP)
        lost_rank = workers[lost]

        def copy_caught_up() -> bool:
            """Rank 0 frozen with its newest snapshot held by the other node: a kill now
            is a node lost after its last copy arrived (the copy trails by a transfer)."""
            lost_rank.send_signal(signal.SIGSTOP)
            wait_for(lambda: stopped(lost_rank.pid), 10, 0.01, "rank 0 stopped")
            held = PeerStore(root / "held").newest(0)
            if held and held.snapshot.step == newest(root / "rank-00000") and \
                    held.snapshot.step > durable_step(run_dir) and \
                    not any(p.name.startswith(".") for p in (root / "rank-00000").iterdir()):
                return True
            lost_rank.send_signal(signal.SIGCONT)
            return False
        wait_for(copy_caught_up, 30, 0.05, "rank 0's newest snapshot held by the other node")
        durable = durable_step(run_dir)
        sealed_at_loss = newest(root / "rank-00000")     # rank 0 is stopped: final
        kill_tree(launchers[lost])                       # the node is lost ...
        held_at_loss = [c.snapshot.step for c in PeerStore(root / "held").copies(0)]
        memory_at_loss = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
        shutil.rmtree(root / "rank-00000")               # ... with its memory
        shutil.rmtree(root / "held" / "rank-00001", ignore_errors=True)
        launchers[kept].send_signal(signal.SIGCONT)

        def resumed():
            assert launchers[kept].poll() is None, (tmp_path / "job.log").read_text()
            return run.events("checkpoint_resumed")
        (event,) = wait_for(resumed, 60, 0.2, "the shrunk world resumed")
    finally:
        for proc in launchers.values():
            kill_tree(proc)
        log.close()
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)

    # The lost rank had sealed step S and was at most in step S+1: the job resumed at S,
    # from the copy the surviving node held; the durable checkpoint was up to 10 behind.
    why = json.dumps({"event": event, "durable": durable, "held_at_loss": held_at_loss,
                      "memory_at_loss": memory_at_loss,
                      "journal": [e for e in run.events() if e.get("rank") is not None
                                  or "snapshot" in str(e.get("event"))][-40:]},
                     default=str, indent=1)
    assert sealed_at_loss > durable and event["step"] == sealed_at_loss, why
    assert event["state_from"] == "peer copy" and event["durable_step"] == durable, event
    assert event["sources"] == {"own": 0, "held": 1, "fetched": 0}, event
    assert event["from_peers"] == [{"rank": 0, "state_of": 0, "copy": "held on its node",
                                    "from_rank": 0, "from_node": kept}], event
    assert event["steps_kept"] == event["step"] - durable >= 1
    (resharded,) = run.events("checkpoint_resharded")
    assert (resharded["from_world_size"], resharded["to_world_size"]) == (2, 1)
    print(f"lost at step {sealed_at_loss} (+1 in flight), resumed {event['step']}, "
          f"durable {durable}")
