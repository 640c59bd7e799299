"""Two gloo ranks resume a sharded checkpoint through the one agreement of the ranks.

``sharded_resume_agreement_job.py OUT`` under torchrun (2 ranks, CPU): a small FSDP2 MLP
saved by ``Checkpoints`` (sync) at steps 1 and 2; rank 0 then flips a byte of rank 1's
shard of step 2, so only rank 1's own hashing can find it, and asks for steps 5-6 to be
skipped (a rollback's control/skip-steps.json); both ranks resume with a new
``Checkpoints`` and each writes OUT/rank-N.json: the step it resumed, whether its weights
are those of step 1, and the steps it skips. Then both resume again through a ``Checkpointer`` of another
config (its hash differs), which rank 0 refuses: each rank writes the error it got.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from trainwatch import Checkpoints
from trainwatch.errors import ConfigError
from trainwatch.rank.checkpoint import CheckpointConfig
from trainwatch.rank.checkpoint.checkpointer import Checkpointer

out = Path(sys.argv[1])
run_dir = out / "run"
dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


model, opt = build(0)
ckpt = Checkpoints.from_env(run_dir, every_steps=1, mode="sync", fsync=False,
                            memory_snapshots="off")
at_step: dict[int, dict[str, torch.Tensor]] = {}
for step in (1, 2):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    ckpt.maybe_save(step, model=model, optimizer=opt)
    at_step[step] = weights(model)
ckpt.close(final=False)
dist.barrier()
if rank == 0:
    shard = run_dir / "checkpoints" / "step-00000002" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (run_dir / "control" / "skip-steps.json").write_text(
        json.dumps({"from_step": 5, "to_step": 6, "reason": "a test's rollback"}))
dist.barrier()

fresh, fresh_opt = build(1)
again = Checkpoints.from_env(run_dir, mode="sync", fsync=False, memory_snapshots="off")
resumed = again.resume(model=fresh, optimizer=fresh_opt)
got = weights(fresh)
same = all(torch.equal(got[k], at_step[1][k]) for k in got)
skipped = [step for step in range(8) if again.should_skip(step)]
again.close(final=False)

refused = None
other = Checkpointer(CheckpointConfig(fsync=False, memory_snapshots="off"), run_dir,
                     config_hash="another-config").start()
try:
    other.resume()
except ConfigError as exc:
    refused = exc.problem
other.close()
(out / f"rank-{rank}.json").write_text(json.dumps(
    {"resumed": resumed, "weights_of_step_1": same, "skipped": skipped, "refused": refused}))
dist.destroy_process_group()
