"""A user's own trainer (not trainwatch's): a DDP regression instrumented with trainwatch
telemetry and saving its last state with trainwatch's Checkpointer, for tests/rehearse/test_rehearse.py.

    [torchrun ...] tests/jobs/rehearse_user_job.py --lr 0.05 [--steps 20] [--abort-on-exit]

``--abort-on-exit``: the last rank aborts (SIGABRT) after training ended, as gloo's
teardown can abort a finished script.

The run directory comes from $TRAINWATCH_RUN_DIR (the own-trainer contract).
"""

import gc
import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainwatch.rank.checkpoint import Checkpointer
from trainwatch.rank.checkpoint.config import CheckpointConfig
from trainwatch.rank.telemetry import Telemetry

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, required=True)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--abort-on-exit", action="store_true")
args = parser.parse_args()

distributed = "WORLD_SIZE" in os.environ
if distributed:
    dist.init_process_group("gloo")
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
model = DDP(net) if distributed else net
opt = torch.optim.SGD(model.parameters(), lr=args.lr)
target = torch.nn.Linear(16, 1)
run_dir = os.environ["TRAINWATCH_RUN_DIR"]
tel = Telemetry.from_env(run_dir, heartbeat_interval=0.2, exchange_every=0).start()
ckpt = Checkpointer(CheckpointConfig(every_steps=0, fsync=False), run_dir, telemetry=tel).start()
g = torch.Generator().manual_seed(1)
for step in range(args.steps):
    with tel.step(step) as s:
        x = torch.randn(64, 16, generator=g)
        y = target(x).detach()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        s.record(loss=loss.detach(), grad_norm=norm, lr=args.lr, samples=64)
    ckpt.after_step(step + 1, lambda: {"model": net.state_dict(), "optimizer": opt.state_dict()},
                    final=step == args.steps - 1)
ckpt.close()
tel.close()
del model  # DDP sits in a reference cycle: only the collector frees it and its hold on
gc.collect()  # the group, so destroy_process_group joins gloo's threads (examples/plain_loop.py)
if distributed:
    dist.destroy_process_group()
if args.abort_on_exit and tel.rank == tel.world_size - 1:
    os.abort()
