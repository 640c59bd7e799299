"""A three-rank job for test_checkpoints_agreed_stop: rank 0 alone is asked to stop
(SIGTERM), every rank agrees at the next step boundary, and the others' own SIGTERMs (their
launcher's, on a node stopped a moment after the other) land while they carry that stop out.

    torchrun --nproc-per-node 3 tests/jobs/agreed_stop_job.py RUN_DIR

Rank 1's SIGTERM comes during the stop's save (its state_dict), rank 2's while its telemetry
writes the final status. Each rank sends it to itself at that point, so where it lands does
not depend on timing.
"""

import os
import signal
import sys

import torch
import torch.distributed as dist

from trainwatch import Checkpoints, Telemetry

run_dir = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
# Asked by no one, these learn of the stop from rank 0, then get their own SIGTERM.
when = {1: "save", 2: "close"}.get(rank)


class Model(torch.nn.Linear):
    def state_dict(self, *args, **kwargs):  # called only by the stop's save (no interval)
        if when == "save":
            os.kill(os.getpid(), signal.SIGTERM)
        return super().state_dict(*args, **kwargs)


class LateTelemetry(Telemetry):
    def close(self, *args, **kwargs):
        if when == "close":
            os.kill(os.getpid(), signal.SIGTERM)
        super().close(*args, **kwargs)


tel = LateTelemetry.from_env(run_dir, heartbeat_interval=0.2).start()
ckpt = Checkpoints.from_env(run_dir, telemetry=tel, every_steps=0, fsync=False)
model = Model(4, 2)
if rank == 0:
    os.kill(os.getpid(), signal.SIGTERM)  # only a flag until the next step boundary
for step in range(1000):
    ckpt.maybe_save(step + 1, model=model)  # the stop agreed at step 1 ends the loop here
print(f"rank {rank}: the loop ran out without stopping", file=sys.stderr)
sys.exit(3)
