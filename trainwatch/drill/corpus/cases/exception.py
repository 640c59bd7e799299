"""Rank 1 raises an uncaught exception."""

from trainwatch.drill.corpus.case import Case, Context, Expect


def shape_error(ctx: Context) -> None:
    raise ValueError(f"corpus: bad batch shape on rank {ctx.rank} at step {ctx.step}")


CASE = Case(
    kind="exception",
    simulates="a rank dies of an uncaught Python exception (a bad batch, a bug in a rare "
              "branch)",
    expect=Expect(category=("rank_dead",), ranks=(1,), cause=("ValueError",)),
    fault=shape_error, ends_job=True)
