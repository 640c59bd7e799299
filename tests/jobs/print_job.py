"""One gloo rank under torchrun that prints a line every step, like most training loops, and
publishes telemetry; it writes its step to PROGRESS (off the run directory's disk) and
finishes at the first step after the file GATE exists.

    torchrun --standalone --nproc-per-node 1 tests/jobs/print_job.py PROGRESS GATE
"""

import os
import sys
import time

import torch
import torch.distributed as dist

from trainwatch.rank.telemetry import Telemetry

progress, gate = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
tel = Telemetry.from_env(heartbeat_interval=0.5).start()
step = 0
while not os.path.exists(gate):
    with tel.step(step) as s:
        t = torch.ones(4)
        dist.all_reduce(t)
        time.sleep(0.02)
        s.record(loss=1.0 / (step + 1))
    print(f"step {step}: loss {1.0 / (step + 1):.4f}", flush=True)
    with open(progress + ".tmp", "w") as fh:
        fh.write(str(step))
    os.replace(progress + ".tmp", progress)
    step += 1
print(f"finished after step {step - 1}", flush=True)
tel.close("finished")
dist.destroy_process_group()
