"""A two-rank DDP job whose batch 23 is corrupt (its loss is NaN), for test_alert_nan_e2e.

    torchrun --nproc-per-node 2 tests/alert_nan_job.py RUN_DIR STEPS

It publishes trainwatch telemetry, checkpoints with the checkpoint library every 5 steps,
resumes from the newest verified checkpoint, and honours the controller's rollback
request ``control/skip-steps.json`` ({"from_step", "to_step"}): the batches of those
steps are dropped, not trained on (journal ``data_skipped``).  The batch of step s is a
pure function of s, so skipping a step skips exactly its data.
"""

import json
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainwatch.rundir import RunDir
from trainwatch.trainer.checkpoint import CheckpointConfig, Checkpointer
from trainwatch.trainer.telemetry import Telemetry

BAD_BATCH = 23
run = RunDir(sys.argv[1])
steps = int(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
target = torch.nn.Linear(8, 1)
tel = Telemetry.from_env(run.root, heartbeat_interval=0.2, exchange_every=0).start()
ckpt = Checkpointer(CheckpointConfig(every_steps=5, fsync=False, keep_last=10), run.root,
                    telemetry=tel).start()
start = 0
restored = ckpt.resume()
if restored is not None:
    model.module.load_state_dict(restored.shared["model"])
    opt.load_state_dict(restored.shared["optimizer"])
    start = restored.step
try:
    skip = json.loads((run.control_dir / "skip-steps.json").read_text())
except FileNotFoundError:
    skip = {"from_step": -1, "to_step": -2}
skipped = []
for step in range(start, steps):
    if skip["from_step"] <= step <= skip["to_step"]:
        skipped.append(step)
        continue
    with tel.step(step) as s:
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, 8, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), target(x).detach())
        if step == BAD_BATCH:
            loss = loss + float("nan")  # a corrupt sample
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        if ckpt.check_step(step, loss, norm, data={"step": step + 1}):
            opt.step()
        s.record(loss=loss.detach(), samples=16)
    ckpt.after_step(step + 1, lambda: {"model": model.module.state_dict(),
                                       "optimizer": opt.state_dict(), "data": {"step": step + 1}},
                    final=step == steps - 1)
    time.sleep(0.3)  # slow enough for the engine to see the NaN long before the end
if skipped and rank == 0:
    run.append_event("data_skipped", "rank0", steps=skipped, reason=skip.get("reason"))
if rank == 0:
    run.append_event("finished", "rank0", step=steps - 1, loss=float(loss))
ckpt.close()
tel.close()
dist.destroy_process_group()
