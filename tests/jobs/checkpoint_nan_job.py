"""A two-rank DDP job for test_checkpoint_ddp: rank 1's loss alone is NaN at step 3.

    torchrun --nproc-per-node 2 tests/jobs/checkpoint_nan_job.py RUN_DIR

The NaN is a constant added to the loss, so gradients stay finite everywhere and rank 0
can only learn about it from the checkpointer's per-step agreement.  Each rank writes
RUN_DIR/result-rank-N.json: which steps it applied and its final weights.
"""

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainwatch.rank.checkpoint import CheckpointConfig, Checkpointer

run_dir = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ckpt = Checkpointer(CheckpointConfig(every_steps=0, save_final=False, fsync=False),
                    run_dir).start()
torch.manual_seed(1 + rank)
applied = []
for step in range(5):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    if rank == 1 and step == 3:
        loss = loss + torch.tensor(float("nan"))
    opt.zero_grad()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    if ckpt.check_step(step, loss, norm, data={"batch": step + 1}):
        opt.step()
        applied.append(step)
    ckpt.after_step(step + 1, dict)
ckpt.close()
(run_dir / f"result-rank-{rank}.json").write_text(json.dumps({
    "applied": applied, "grad_norm_finite": bool(torch.isfinite(norm)),
    "weights": [p.detach().flatten().tolist() for p in model.parameters()]}))
del model  # DDP sits in a reference cycle: only the collector frees it and its hold on
gc.collect()  # the group, so destroy_process_group joins gloo's threads (examples/plain_loop.py)
dist.destroy_process_group()
