"""Your own DDP training loop with trainwatch's whole safety net (docs/own-trainer.md).

    trainwatch run --run-dir runs/own -- torchrun --standalone --nproc-per-node 2 \\
        examples/own_loop.py --steps 300

Under ``trainwatch run`` the job is watched (agent, alerts), restarted after a crash or a
stall and resumes where its newest verified checkpoint left it, rolled back past a NaN,
and stopped with a checkpoint on Ctrl-C. Alone (``torchrun ... examples/own_loop.py``) it
still publishes telemetry and checkpoints into ``$TRAINWATCH_RUN_DIR`` (default
``trainwatch-run``). The lines marked ``# trainwatch`` are all trainwatch asks for.

``--poison-step N`` feeds a NaN batch at step N in the first launch only: watch the
rollback skip it. ``--pace S`` sleeps S seconds per step, to watch a short run live.
"""

import gc
import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainwatch import Checkpoints, Telemetry  # trainwatch


def batch(step: int, rank: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch for ``step``: a function of the step, so the data position is the
    step itself and a resumed run reads exactly the batches an uninterrupted one would."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(size, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--pace", type=float, default=0.0, help="seconds of sleep per step")
    parser.add_argument("--poison-step", type=int, help="NaN batch at this step (first launch)")
    parser.add_argument("--memory-snapshots", default="auto", choices=("auto", "every_step", "off"),
                        help="in-memory snapshots (docs/memory-snapshots.md)")
    args = parser.parse_args()

    distributed = "WORLD_SIZE" in os.environ
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if distributed else 0

    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(64, 1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)
    torch.manual_seed(1 + rank)  # per-rank dropout streams (saved and restored per rank)
    ddp = DDP(model) if distributed else model

    tel = Telemetry.from_env(device=device).start()                       # trainwatch
    ckpt = Checkpoints.from_env(every_steps=args.checkpoint_every,        # trainwatch
                                memory_snapshots=args.memory_snapshots)
    start = ckpt.resume(model=model, optimizer=opt, scheduler=sched)     # trainwatch
    first_launch = os.environ.get("TRAINWATCH_LAUNCH", "1") == "1"
    for step in range(start, args.steps):
        if ckpt.should_skip(step):                                        # trainwatch
            continue
        with tel.step(step) as s:                                         # trainwatch
            with tel.phase("data"):                                       # trainwatch
                x, y = (t.to(device) for t in batch(step, rank))
                if first_launch and step == args.poison_step:
                    x = x * float("nan")
            with tel.phase("forward"):                                    # trainwatch
                loss = torch.nn.functional.mse_loss(ddp(x), y)
            with tel.phase("backward"):                                   # trainwatch
                opt.zero_grad(set_to_none=True)
                loss.backward()
            with tel.phase("optimizer"):                                  # trainwatch
                opt.step()
                sched.step()
            s.record(loss=loss, lr=sched.get_last_lr()[0], samples=x.shape[0])  # trainwatch
        ckpt.maybe_save(step + 1, model=model, optimizer=opt, scheduler=sched)  # trainwatch
        if args.pace:
            time.sleep(args.pace)
    ckpt.close()                                                          # trainwatch
    tel.close()                                                           # trainwatch
    if distributed:
        del ddp  # DDP sits in a reference cycle: free it (and its hold on the group) before
        gc.collect()  # destroy_process_group, or gloo's threads outlive the interpreter
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
