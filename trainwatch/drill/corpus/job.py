"""The corpus's training job: a small gloo loop with trainwatch telemetry, one training
all_reduce a step, into which a corpus case injects its fault (``TRAINWATCH_CORPUS_CASE``).

    torchrun --standalone --nproc-per-node N -m trainwatch.drill.corpus.job STEPS

The faulty rank journals ``fault_injected`` (kind, step) just before the fault runs: the
moment the corpus times detection and diagnosis from.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from trainwatch.drill.corpus.case import CASE_ENV, WORKDIR_ENV, Case, Context, load
from trainwatch.rank.telemetry import Telemetry


class Batches(Dataset):
    """Random regression batches of 16 samples (a mean over 16, so the loss is as smooth as a
    real job's: a single sample's loss spikes 3x its mean now and then, and a clean run
    must page nobody); a case's ``item`` hook runs first (in a worker, if any)."""

    def __init__(self, case: Case, ctx: Context):
        self.case, self.ctx = case, ctx

    def __len__(self) -> int:
        return 10**9

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.case.item is not None:
            self.case.item(self.ctx, index)
        g = torch.Generator().manual_seed(index * 100 + self.ctx.rank)
        return torch.randn(16, 32, generator=g)


def abort_on_error() -> None:
    report = sys.excepthook

    def abort(*exc_info):
        report(*exc_info)
        sys.stderr.flush()
        os.abort()
    sys.excepthook = abort


def main() -> None:
    case = load(os.environ[CASE_ENV])
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 100000
    dist.init_process_group("gloo")
    if case.abort_on_error:
        abort_on_error()
    world = dist.get_world_size()
    ctx = Context(rank=dist.get_rank(), world_size=world, fault_rank=case.fault_rank,
                  fault_step=case.fault_step, workdir=Path(os.environ[WORKDIR_ENV]))
    ctx.side_group = dist.new_group(list(range(world)))
    tel = Telemetry.from_env(heartbeat_interval=0.2, exchange_every=5).start()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    target = torch.nn.Linear(32, 1)
    loader = iter(DataLoader(Batches(case, ctx), batch_size=None,
                             num_workers=case.data_workers))

    def at(phase: str) -> None:
        if case.fault is None and case.item is None and case.every_step is None:
            return  # a clean run
        if ctx.faulty and ctx.step == case.fault_step and phase == case.phase:
            tel.event("fault_injected", fault=case.kind, step=ctx.step)
            if case.fault is not None:
                case.fault(ctx)

    for step in range(steps):
        ctx.step = step
        with tel.step(step) as s:
            with tel.phase("data"):
                at("data")
                x = next(loader)
                y = target(x).detach()
            with tel.phase("forward"):
                at("forward")
                time.sleep(case.step_seconds + ctx.extra_seconds)
                loss = torch.nn.functional.mse_loss(model(x), y)
            with tel.phase("backward"):
                opt.zero_grad()
                loss.backward()
            with tel.phase("allreduce"):
                at("allreduce")
                flat = torch.cat([p.grad.flatten() for p in model.parameters()])
                dist.all_reduce(flat)
                offset = 0
                for p in model.parameters():
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p) / world)
                    offset += p.numel()
            with tel.phase("metrics"):  # a user's phase, which may hold a side collective
                at("metrics")
                if case.every_step is not None:
                    case.every_step(ctx)
            with tel.phase("optimizer"):
                opt.step()
            s.record(loss=loss.item() * ctx.loss_scale, lr=0.01, samples=x.shape[0])
    tel.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
