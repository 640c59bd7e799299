"""Rank 1 reads a pipe whose writer never writes."""

from trainwatch.drill.corpus.case import Case, Context, Expect


def read_pipe(ctx: Context) -> None:
    import os
    read_end, write_end = os.pipe()  # the writer (kept open) never writes
    os.read(read_end, 1)


CASE = Case(
    kind="pipe",
    simulates="a rank blocks reading a pipe whose writer never writes (a subprocess "
              "handshake that never comes)",
    expect=Expect(category=("rank_stuck",), ranks=(1,), cause=("pipe",)),
    fault=read_pipe, phase="data")
