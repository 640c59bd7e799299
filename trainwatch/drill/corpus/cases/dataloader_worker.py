"""A DataLoader worker of rank 1 blocks opening a FIFO nobody writes."""

import os
from pathlib import Path

from trainwatch.drill.corpus.case import Case, Context, Expect


def make_fifo(work: Path) -> dict[str, str]:
    os.mkfifo(work / "shard.fifo")
    return {}


def read_shard(ctx: Context, index: int) -> None:
    if ctx.faulty and index == ctx.fault_step:
        with open(ctx.workdir / "shard.fifo", "rb") as fifo:
            fifo.read(1)


CASE = Case(
    kind="dataloader_worker",
    simulates="a DataLoader worker process hangs (a shard on a dead mount, a FIFO): the rank "
              "waits for its batch forever",
    expect=Expect(category=("rank_stuck",), ranks=(1,), cause=("worker",)),
    item=read_shard, phase="data", data_workers=2, prepare=make_fifo)
