"""A user's DDP loop fed by a torch DataLoader with worker processes (num_workers=2),
integrated as docs/own-trainer.md says, for tests/control/test_own_loop_dataloader_e2e.py.
"""

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainwatch import Checkpoints, Telemetry


def own_process_group(worker_id: int) -> None:
    """Out of the rank's process group: torchrun's SIGTERM to it must not kill the workers."""
    os.setpgrp()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100000)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(4096, 8), torch.randint(0, 2, (4096,)))
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data), num_workers=2,
                        worker_init_fn=own_process_group)
    tel = Telemetry.from_env().start()
    ckpt = Checkpoints.from_env(every_steps=0)
    start = ckpt.resume(model=model, optimizer=opt)
    batches = iter(loader)
    for step in range(start, args.steps):
        with tel.step(step) as s:
            try:
                x, y = next(batches)
            except StopIteration:
                batches = iter(loader)
                x, y = next(batches)
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            s.record(loss=loss, samples=x.shape[0])
        time.sleep(0.02)
        ckpt.maybe_save(step + 1, model=model, optimizer=opt)
    ckpt.close()
    tel.close()
    del ddp, model, batches, loader
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
