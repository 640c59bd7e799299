"""A user's FSDP loop on CPU (gloo) with the documented Telemetry + Checkpoints lines.

A tiny transformer sharded with fully_shard over a 1-D mesh (``--fsdp1``: wrapped in FSDP1's
FullyShardedDataParallel instead), AdamW; ``--mode`` is the checkpoint mode,
``--no-resume`` leaves out ``ckpt.resume`` so the first save meets the state first.
Trainwatch saves FSDP2's and FSDP1's sharded state through DCP.
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

from trainwatch import Checkpoints, Telemetry

parser = argparse.ArgumentParser()
parser.add_argument("--mode", default="async")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--no-resume", action="store_true")
parser.add_argument("--fsdp1", action="store_true")
args = parser.parse_args()

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Embedding(64, 32),
    torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True),
    torch.nn.Linear(32, 64))
if args.fsdp1:
    model = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
else:
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

tel = Telemetry.from_env().start()
ckpt = Checkpoints.from_env(every_steps=5, mode=args.mode)
start = 0 if args.no_resume else ckpt.resume(model=model, optimizer=opt)
for step in range(start, args.steps):
    with tel.step(step) as s:
        tokens = torch.randint(0, 64, (4, 16))
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        s.record(loss=loss.item())
    ckpt.maybe_save(step + 1, model=model, optimizer=opt)
ckpt.close()
tel.close()
dist.destroy_process_group()
