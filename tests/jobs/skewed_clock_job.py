"""A small DDP job whose rank 1 reads a wall clock TW_SKEW seconds behind (like a node whose
clock drifted), for the false-page and report tests.

    trainwatch run RUN_DIR -- torchrun --standalone --nproc-per-node 2 \
        tests/jobs/skewed_clock_job.py STEPS SECONDS_PER_STEP

Every wall-clock read of rank 1's process is shifted (time.time, before trainwatch is
imported), as libfaketime would; its monotonic clock and the kernel's are untouched.
"""

import gc
import os
import sys
import time

if os.environ.get("RANK") == "1":
    _real_time, _skew = time.time, float(os.environ.get("TW_SKEW", "300"))
    time.time = lambda: _real_time() - _skew

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainwatch.rank.telemetry import Telemetry

steps, pace = int(sys.argv[1]), float(sys.argv[2])
dist.init_process_group("gloo")
torch.manual_seed(0)
# One batch every step: the loss falls smoothly. A fresh random batch of 4 made it noisy
# enough for TrainingLossSpike (3x its recent mean) to fire and roll the job back in CI;
# the loss is not what this job tests.
batch = torch.randn(4, 8)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
tel = Telemetry.from_env(heartbeat_interval=0.5, exchange_every=5).start()
for step in range(steps):
    with tel.step(step) as s:
        with tel.phase("forward"):
            time.sleep(pace)
            loss = model(batch).pow(2).mean()
        with tel.phase("backward"):
            loss.backward()
        with tel.phase("optimizer"):
            opt.step()
            opt.zero_grad()
        s.record(loss=loss.detach(), tokens=4, samples=4)
tel.close()
del model  # DDP sits in a reference cycle: only the collector frees it and its hold on
gc.collect()  # the group, so destroy_process_group joins gloo's threads (examples/plain_loop.py)
dist.destroy_process_group()
