"""A 2-rank DDP job whose rank 1 aborts (SIGABRT) in its first launch, as gloo's teardown
can abort a script that finished: ``after`` the last status (training ended), or
``before`` it (a real crash mid-job). Later launches exit cleanly.

    torchrun --standalone --nproc-per-node 2 tests/jobs/teardown_abort_job.py after|before
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainwatch.rank.telemetry import Telemetry

when = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
first_launch = os.environ.get("TRAINWATCH_LAUNCH") == "1"
# The same model and batch in every launch: a launch's loss is then never 3x the one before
# it (a fresh random model's can be, and TrainingLossSpike's rollback_skip restarted the
# job once more in CI); the loss is not what this job tests.
torch.manual_seed(0)
batch = torch.randn(4, 8)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
tel = Telemetry.from_env(heartbeat_interval=0.2).start()
for step in range(5):
    with tel.step(step) as s:
        loss = model(batch).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        s.record(loss=loss)
if first_launch and rank == 1 and when == "before":
    os.abort()
tel.close()
del model
dist.destroy_process_group()
if first_launch and rank == 1 and when == "after":
    os.abort()
