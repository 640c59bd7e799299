"""A user's FSDP2 training loop on CPU (gloo) protected by the documented Checkpoints lines.

A tiny transformer, ``fully_shard`` per layer and whole over a 1-D mesh, AdamW, a seeded
synthetic loader whose position is the global sample count (so it continues at any world
size). For the tests, rank 0 appends the digest of the gathered full model + optimizer
state after every step (and right after resume) to ``--out``/digests.jsonl, and
``--kill-at N`` SIGKILLs rank 1 before step N on the first attempt, once the save
before it (if any) is sealed; with ``--tear-shard`` rank 1 first flips a byte of its shard
file in that checkpoint (the restart must fall back past it). ``--memory-snapshots`` is
the Checkpoints setting of that name. ``--fsdp1`` wraps the model in FSDP1's
FullyShardedDataParallel (FlatParameters, the optimizer over them) instead of fully_shard.
"""

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

from trainwatch import Checkpoints

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--every", type=int, default=2)
parser.add_argument("--kill-at", type=int, default=None)
parser.add_argument("--tear-shard", action="store_true")
parser.add_argument("--memory-snapshots", default="auto")
parser.add_argument("--fsdp1", action="store_true")
parser.add_argument("--out", required=True)
args = parser.parse_args()
GLOBAL_BATCH = 8


class Loader:
    """Samples by global index from a fixed seed; each rank takes its slice of the batch."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world, self.samples = rank, world, 0

    def next(self) -> torch.Tensor:
        per_rank = GLOBAL_BATCH // self.world
        first = self.samples + self.rank * per_rank
        self.samples += GLOBAL_BATCH
        rows = [torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(1000 + i))
                for i in range(first, first + per_rank)]
        return torch.stack(rows)

    def state_dict(self) -> dict:
        return {"samples": self.samples}

    def load_state_dict(self, state: dict) -> None:
        self.samples = state["samples"]


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str | None:
    """Of the full (gathered) model and optimizer state; on rank 0 (a collective)."""
    # FSDP1's cpu_offload of CPU tensors fails in torch 2.13 ("setStorage: ... out of bounds")
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(
        full_state_dict=True, cpu_offload=not args.fsdp1))
    if dist.get_rank() != 0:
        return None
    h = hashlib.sha256()
    for key in sorted(msd):
        h.update(key.encode() + msd[key].numpy().tobytes())
    for fqn in sorted(osd["state"]):
        for name, value in sorted(osd["state"][fqn].items()):
            h.update(f"{fqn}.{name}".encode() + torch.as_tensor(value).numpy().tobytes())
    return h.hexdigest()


def note(step: int, what: str, model, opt, loss: float | None = None) -> None:
    value = digest(model, opt)
    if value is not None:
        with open(Path(args.out) / "digests.jsonl", "a") as fh:
            fh.write(json.dumps({"step": step, "what": what, "digest": value, "loss": loss,
                                 "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                                 "world": dist.get_world_size()}) + "\n")


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Embedding(64, 32),
    torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True),
    torch.nn.Linear(32, 64))
if args.fsdp1:
    model = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
else:
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
loader = Loader(rank, world)

ckpt = Checkpoints.from_env(every_steps=args.every, keep_last=3,
                            memory_snapshots=args.memory_snapshots)
start = ckpt.resume(model=model, optimizer=opt, data=loader)
if start:
    note(start, "resumed", model, opt)
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
for step in range(start, args.steps):
    if step == args.kill_at and rank == 1 and first_attempt:
        saved = Path(os.environ["TRAINWATCH_RUN_DIR"], "checkpoints",
                     f"step-{step // args.every * args.every:08d}")
        deadline = time.monotonic() + (60 if step >= args.every else 0)
        while not saved.exists() and time.monotonic() < deadline:  # an async save: sealed
            time.sleep(0.05)
        if args.tear_shard:
            with open(saved / "__1_0.distcp", "r+b") as fh:
                fh.seek(100)
                byte = fh.read(1)
                fh.seek(100)
                fh.write(bytes([byte[0] ^ 0xFF]))
        os.kill(os.getpid(), signal.SIGKILL)
    tokens = loader.next()
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    note(step + 1, "trained", model, opt, loss.item())
    ckpt.maybe_save(step + 1, model=model, optimizer=opt, data=loader)
ckpt.close()
dist.destroy_process_group()
