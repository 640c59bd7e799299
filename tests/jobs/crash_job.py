"""Two gloo ranks under torchrun, one all_reduce per step, a heartbeat every 30 s: rank 1
raises at step 30, uncaught, long before any heartbeat; rank 0 then fails in the
all_reduce of its step 30 (the peer is gone).

    torchrun --standalone --nproc-per-node 2 tests/jobs/crash_job.py RUN_DIR
"""

import sys
import time

import torch
import torch.distributed as dist

from trainwatch.rank.telemetry import Telemetry

CRASH_STEP = 30

dist.init_process_group("gloo")
rank = dist.get_rank()
tel = Telemetry.from_env(sys.argv[1], heartbeat_interval=30).start()
for step in range(1000):
    with tel.step(step) as s:
        with tel.phase("forward"):
            time.sleep(0.01)
            if rank == 1 and step == CRASH_STEP:
                raise RuntimeError("a bug in the loss at step 30")
        with tel.phase("allreduce"):
            t = torch.ones(4)
            dist.all_reduce(t)
        s.record(loss=float(step))
