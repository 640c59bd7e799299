"""A plain torch DDP loop (not trainwatch's trainer) publishing trainwatch telemetry.

    torchrun --standalone --nproc-per-node 2 examples/plain_loop.py RUN_DIR [STEPS]

The lines marked ``# trainwatch`` are all it takes.

The loop lives in ``main()`` so the model (and with it the process group) is freed
before the interpreter shuts down: gloo's worker threads can still be letting go of
the last all-reduce's tensors then, and a thread that needs Python during shutdown
aborts the process ("terminate called without an active exception", about 1 run in
40 on a 2-core VM when the model is a module-level global).
"""

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainwatch.trainer.telemetry import Telemetry  # trainwatch


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
    dist.destroy_process_group()
