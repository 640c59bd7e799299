"""Rank 1 computes at 0.8x the speed of the others."""

from trainwatch.drill.corpus.case import Case, Context, Expect

STEP_SECONDS = 0.1


def slow_down(ctx: Context) -> None:
    ctx.extra_seconds = STEP_SECONDS * (1 / 0.8 - 1)  # its compute takes 1.25x as long


CASE = Case(
    kind="straggler_08x",
    simulates="a straggler at 0.8x: one rank computes 25 % slower (a throttled GPU, a noisy "
              "neighbour); the job goes on, slower",
    expect=Expect(category=("straggler",), ranks=(1,), cause=("straggler",)),
    fault=slow_down, step_seconds=STEP_SECONDS)
