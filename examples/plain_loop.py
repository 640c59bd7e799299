"""A plain torch DDP loop (not trainwatch's trainer) publishing trainwatch telemetry.

    torchrun --standalone --nproc-per-node 2 examples/plain_loop.py RUN_DIR [STEPS]

The lines marked ``# trainwatch`` are all it takes.

The loop lives in ``main()`` and the garbage collector runs before
``destroy_process_group``: DDP sits in a reference cycle (its hooks refer to it), so only
the collector frees it and its hold on the process group. Otherwise the group outlives
``destroy_process_group``, gloo's worker threads are still letting go of the last
all-reduce's tensors while the interpreter shuts down, and a thread that needs Python
then aborts the process ("terminate called without an active exception": rare, and
only at exit).
"""

import gc
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainwatch.rank.telemetry import Telemetry  # trainwatch


def main(run_dir: str, steps: int) -> None:
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    target = torch.nn.Linear(32, 1)

    tel = Telemetry.from_env(run_dir, heartbeat_interval=0.2, exchange_every=5).start()  # trainwatch
    for step in range(steps):
        with tel.step(step) as s:                                      # trainwatch
            with tel.phase("data"):                                    # trainwatch
                x = torch.randn(64, 32)
                y = target(x).detach()
            with tel.phase("forward"):                                 # trainwatch
                loss = torch.nn.functional.mse_loss(model(x), y)
            with tel.phase("backward"):                                # trainwatch
                opt.zero_grad()
                loss.backward()
            with tel.phase("optimizer"):                               # trainwatch
                opt.step()
            s.record(loss=loss, lr=0.05, samples=x.shape[0])           # trainwatch
    tel.close()                                                        # trainwatch


if __name__ == "__main__":
    dist.init_process_group("gloo")
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30)
    gc.collect()  # DDP sits in a reference cycle: free it (and its hold on the group) now
    dist.destroy_process_group()
