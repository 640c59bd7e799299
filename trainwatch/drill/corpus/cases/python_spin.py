"""Rank 1 spins in pure Python."""

from trainwatch.drill.corpus.case import Case, Context, Expect


def spin(ctx: Context) -> None:
    done = False
    while not done:  # the bug: a retry loop whose condition never changes
        pass


CASE = Case(
    kind="python_spin",
    simulates="a rank spinning in pure Python (a retry loop whose exit never comes): "
              "100 % CPU, heartbeats go on, no step",
    expect=Expect(category=("rank_stuck",), ranks=(1,), cause=("busy",)),
    fault=spin)
