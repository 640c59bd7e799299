"""Rank 1's loss turns NaN from the fault step on."""

from trainwatch.drill.corpus.case import Case, Context, Expect


def poison(ctx: Context) -> None:
    ctx.loss_scale = float("nan")


CASE = Case(
    kind="nan_loss",
    simulates="a rank's loss turns NaN (a corrupt batch, a numeric blow-up in its shard)",
    expect=Expect(category=("nonfinite_loss",), ranks=(1,), cause=("nan",)),
    fault=poison)
