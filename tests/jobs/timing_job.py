"""A gloo job whose ranks take different local times: rank r sleeps (1 + r/4) x 20 ms a
step, the last rank (world - 1) twice as long, so the exchanged summary has one slowest
rank and a spread. Telemetry exchanges every 5 steps; 30 steps, then a clean exit.

    torchrun --standalone --nproc-per-node N timing_job.py RUN_DIR
"""

import gc
import sys
import time

import torch.distributed as dist

from trainwatch.rank.telemetry import Telemetry

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
tel = Telemetry.from_env(sys.argv[1], heartbeat_interval=0.2, exchange_every=5).start()
seconds = 0.04 if rank == world - 1 else 0.02 * (1 + rank / 4)
for step in range(30):
    with tel.step(step):
        with tel.phase("forward"):
            time.sleep(seconds)
tel.close()
gc.collect()  # see docs/own-trainer.md: collect before destroying the group
dist.destroy_process_group()
