"""A small DDP job for the agent tests: real gloo ranks publishing trainwatch telemetry.

    torchrun --standalone --nproc-per-node 2 tests/jobs/agent_job.py RUN_DIR

Each step "computes" for a fixed time (a sleep inside the forward phase, so timing is
steady on a loaded machine).  Control files in RUN_DIR/control steer it:
``slow-<rank>`` makes that rank's forward phase TW_SLOW_EXTRA seconds longer (about
0.8x speed by default) while the file exists, and the rank notes its first slow step
in ``slow-<rank>.from`` and its first normal one after that in ``slow-<rank>.until``; ``stop`` ends the job cleanly.
TW_IGNORE_SIGTERM=1: the ranks ignore SIGTERM (only SIGKILL stops them).
TW_EXCHANGE_EVERY: steps per timing window (5 unless set).
"""

import gc
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainwatch.rank.telemetry import Telemetry

run_dir = sys.argv[1]
max_steps = int(sys.argv[2]) if len(sys.argv) > 2 else 100000
base = float(os.environ.get("TW_STEP_SLEEP", "0.1"))
extra = float(os.environ.get("TW_SLOW_EXTRA", "0.03"))

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
tel = Telemetry.from_env(run_dir, heartbeat_interval=0.2,
                         exchange_every=int(os.environ.get("TW_EXCHANGE_EVERY", "5"))).start()
if os.environ.get("TW_IGNORE_SIGTERM") == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
control = os.path.join(run_dir, "control")
stop = torch.zeros(1)
for step in range(max_steps):
    with tel.step(step) as s:
        with tel.phase("data"):
            x = torch.randn(32, 16)
            y = x.sum(dim=1, keepdim=True)
        with tel.phase("forward"):
            slow = os.path.exists(f"{control}/slow-{rank}")
            if slow and not os.path.exists(f"{control}/slow-{rank}.from"):
                with open(f"{control}/slow-{rank}.from", "w") as fh:  # first slow step
                    fh.write(str(step))
            elif not slow and os.path.exists(f"{control}/slow-{rank}.from") \
                    and not os.path.exists(f"{control}/slow-{rank}.until"):
                with open(f"{control}/slow-{rank}.until", "w") as fh:  # first fast step after
                    fh.write(str(step))
            time.sleep(base + (extra if slow else 0.0))
            loss = torch.nn.functional.mse_loss(model(x), y)
        with tel.phase("backward"):
            opt.zero_grad()
            loss.backward()
        with tel.phase("optimizer"):
            opt.step()
        s.record(loss=loss, lr=0.01, samples=32)
    if step % 10 == 0:  # every rank agrees on when to stop
        stop.fill_(1.0 if os.path.exists(f"{control}/stop") else 0.0)
        dist.all_reduce(stop)
        if stop.item() > 0:
            break
tel.close()
del model  # DDP sits in a reference cycle: only the collector frees it and its hold on
gc.collect()  # the group, so destroy_process_group joins gloo's threads (examples/plain_loop.py)
dist.destroy_process_group()
