"""Two gloo ranks on two "nodes" (TRAINWATCH_NODE node-0, node-1: one rank each, so peer
copies run and node-1 has no survivor), memory snapshots every 4 steps; on the first
attempt rank 1 is SIGKILLed in step KILL_STEP, once its part of the step before reached
rank 0, while rank 0 waits in that step's all_reduce, and stays blocked there.

    torchrun --nproc-per-node 2 tests/jobs/blocked_survivor_job.py SHM OUT STEPS KILL_STEP

Before it dies, rank 1 forks a child that keeps its sockets open (as a data loader's worker
or any forked helper does), so rank 0's all_reduce sees no closed connection: it stays in C,
where its Python SIGTERM handler cannot run, when torchrun SIGTERMs it. The child (its pid
in OUT/holder.pid) lets go once rank 0's gasp is sealed, or after HOLD_S: then rank 0's
all_reduce fails and the job ends. Launched again with KILL_STEP -1, the ranks resume
(OUT/resumed-R.json: the step each started from) and run to STEPS.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainwatch import Checkpoints

SHM, OUT, STEPS, KILL_STEP = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
HOLD_S = 10.0


def gasp_sealed() -> bool:
    """Rank 0's gasp is in place (sealed files are renamed in; dot-names are not yet)."""
    return any(n.endswith(".snap") and not n.startswith(".")
               for folder, _, names in os.walk(SHM) if folder.endswith("gasp/rank-00000")
               for n in names)


def hold_sockets_then_die(ckpt: Checkpoints, step: int) -> None:
    """Rank 1: its part of ``step`` held by rank 0 (a part a node dies before sending is
    lost with it), a child keeps the gloo connections open; then this rank is SIGKILLed."""
    copies = ckpt.checkpointer.memory.peers.copies
    assert copies is not None and copies.part_sender.wait_sent(step, 30)
    if os.fork() == 0:
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        (OUT / "holder.pid").write_text(str(os.getpid()))
        deadline = time.monotonic() + HOLD_S
        while time.monotonic() < deadline and not gasp_sealed():
            time.sleep(0.05)
        os._exit(0)
    while not (OUT / "holder.pid").exists():
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    os.environ["TRAINWATCH_NODE"] = f"node-{os.environ['LOCAL_RANK']}"  # one rank a node
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    first = KILL_STEP >= 0
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with Checkpoints.from_env(every_steps=10, fsync=False, memory_snapshots_every=4,
                              memory_snapshots_dir=str(SHM)) as ckpt:
        start = ckpt.resume(model=model, optimizer=opt)
        if not first:
            (OUT / f"resumed-{rank}.json").write_text(json.dumps({"start": start}))
        for step in range(start, STEPS):
            model(torch.randn(4, 8)).square().mean().backward()
            if first and step == KILL_STEP and rank == 1:
                hold_sockets_then_die(ckpt, step)
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)  # rank 0 waits here for the rank that died
            opt.step()
            opt.zero_grad()
            ckpt.maybe_save(step + 1, model=model, optimizer=opt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
