"""Rank 1 opens a FIFO nobody writes, loading its batch."""

import os
from pathlib import Path

from trainwatch.drill.corpus.case import Case, Context, Expect


def make_fifo(work: Path) -> dict[str, str]:
    os.mkfifo(work / "batches.fifo")
    return {}


def read_fifo(ctx: Context) -> None:
    with open(ctx.workdir / "batches.fifo", "rb") as fifo:
        fifo.read(1)


CASE = Case(
    kind="fifo",
    simulates="a rank blocks opening a FIFO nobody writes (a data pipe whose producer died)",
    expect=Expect(category=("rank_stuck",), ranks=(1,), cause=("fifo",)),
    fault=read_fifo, phase="data", prepare=make_fifo)
