"""A plain DDP loop (not the reference trainer) with Telemetry's reduction checksum:
``reduction_job.py RUN_DIR STEPS EVERY DTYPE`` trains a small MLP on random data under
torchrun (gloo), checking the all-reduce every EVERY steps and digesting the replicas at
the same steps. TRAINWATCH_FAULT=reduce:... corrupts a bucket in transit. A sixth argument,
``twin``, also trains a copy without the hook and prints the largest gradient difference
between the two, relative to the largest rank-local gradient (the unchecked steps' mean against DDP's
own)."""

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainwatch.trainer.faults import FaultInjector
from trainwatch.rank.telemetry import Telemetry

run_dir, steps, every, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64),
                            torch.nn.GELU(), torch.nn.Linear(64, 1)).to(getattr(torch, dtype))
twin_model = copy.deepcopy(model) if sys.argv[5:] == ["twin"] else None
twin = DDP(twin_model, bucket_cap_mb=0.05) if twin_model is not None else None
local = copy.deepcopy(model)  # the twin's rank-local gradient: the rounding's scale
worst = 0.0
# Small buckets: several all-reduces per step, each checked on its own.
ddp = DDP(model, bucket_cap_mb=0.05)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
tel = Telemetry.from_env(run_dir, heartbeat_interval=0.2).start()
check = tel.check_reduction(ddp, every=every)
tel.check_replicas(model, every=every)
faults = FaultInjector.from_env(rank)
if faults.reduces:
    check.tamper = faults.reduce
generator = torch.Generator().manual_seed(1 + rank)  # each rank its own data
for step in range(steps):
    with tel.step(step) as record:
        x = torch.randn(32, 64, generator=generator).to(model[0].weight.dtype)
        loss = (ddp(x).float() - x[:, :1].float()).pow(2).mean()
        loss.backward()
        if twin is not None:
            for copied in (twin_model, local):
                copied.load_state_dict(model.state_dict())
            (twin(x).float() - x[:, :1].float()).pow(2).mean().backward()
            (local(x).float() - x[:, :1].float()).pow(2).mean().backward()
            scales = torch.stack([q.grad.abs().max().float() for q in local.parameters()])
            dist.all_reduce(scales, op=dist.ReduceOp.MAX)
            for p, q, scale in zip(model.parameters(), twin_model.parameters(), scales):
                difference = (p.grad.float() - q.grad.float()).abs().max()
                worst = max(worst, (difference / scale.clamp_min(1e-30)).item())
            twin_model.zero_grad(set_to_none=True)
            local.zero_grad(set_to_none=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        record.record(loss=loss.detach())
tel.close()
if twin is not None:
    # One write of the whole line: ranks share torchrun's stderr pipe, and print's separate
    # writes of text and newline let another rank's line land between them.
    os.write(2, f"twin gradient difference {worst!r}\n".encode())
dist.destroy_process_group()
