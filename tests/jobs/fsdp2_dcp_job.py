"""A user's FSDP2 loop that saves with torch.distributed.checkpoint and declares each save.

``fsdp2_dcp_job.py STEPS EVERY`` under torchrun (gloo, CPU): a small MLP sharded with
fully_shard, ``dcp.save`` of model and optimizer every EVERY steps into
RUN_DIR/checkpoints/step-N, declared by rank 0 with ``tel.checkpoint_saved`` once the save
returned (every rank's shards and .metadata written). The recipe of docs/checkpoints.md,
"Declared DCP checkpoints".
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from trainwatch import Telemetry

steps, every = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo")
tel = Telemetry.from_env(heartbeat_interval=0.2).start()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
folder = os.path.join(os.environ["TRAINWATCH_RUN_DIR"], "checkpoints")
generator = torch.Generator().manual_seed(1 + dist.get_rank())
for step in range(steps):
    with tel.step(step) as s:
        x = torch.randn(16, 8, generator=generator)
        loss = (model(x) - x[:, :1]).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        s.record(loss=loss.detach())
    if (step + 1) % every == 0:
        path = os.path.join(folder, f"step-{step + 1:08d}")
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=path)
        if dist.get_rank() == 0:
            tel.checkpoint_saved(path, step + 1)  # steps it holds: where a resume continues
tel.close()
dist.destroy_process_group()
