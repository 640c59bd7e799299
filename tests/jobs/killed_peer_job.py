"""A small DDP job (gloo, Telemetry + Checkpoints) whose rank 1 is SIGKILLed while rank 0
loads a slow batch, on the first launch only.

    torchrun --standalone --nproc-per-node 2 tests/jobs/killed_peer_job.py STEPS KILL_STEP SLOW_S

At KILL_STEP rank 0 spends SLOW_S seconds in its data phase and rank 1 kills itself.
torchrun sees rank 1 die at once and sends rank 0 SIGTERM, which ``Checkpoints`` defers to
the end of the step: rank 0 beats on without a step, then fails in the all-reduce of the
dead peer. The silence is teardown, not a stall.
"""

import gc
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainwatch import Checkpoints, Telemetry

steps, kill_step, slow_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])


def train() -> None:
    rank = dist.get_rank()
    first_launch = os.environ.get("TRAINWATCH_LAUNCH", "1") == "1"
    tel = Telemetry.from_env(heartbeat_interval=0.2).start()
    ckpt = Checkpoints.from_env(every_steps=10)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = ckpt.resume(model=model, optimizer=opt)
    ddp = DistributedDataParallel(model)
    for step in range(start, steps):
        with tel.step(step) as s:
            with tel.phase("data"):
                g = torch.Generator().manual_seed(step * 100 + rank)
                x = torch.randn(16, 32, generator=g)
                time.sleep(0.05)
                if first_launch and step == kill_step and rank == 0:
                    time.sleep(slow_s)
            if first_launch and step == kill_step and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            with tel.phase("forward"):
                loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True))
            with tel.phase("backward"):
                loss.backward()
            with tel.phase("optimizer"):
                opt.step()
                opt.zero_grad()
            s.record(loss=loss, samples=x.shape[0])
        ckpt.maybe_save(step + 1, model=model, optimizer=opt)
    ckpt.close()
    tel.close()


dist.init_process_group("gloo")
train()
gc.collect()
dist.destroy_process_group()
