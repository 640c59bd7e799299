"""Rank 1 backtracks in a regular expression: busy in C, the GIL held."""

from trainwatch.drill.corpus.case import Case, Context, Expect


def catastrophic_regex(ctx: Context) -> None:
    import re
    re.match(r"(a+)+$", "a" * 40 + "b")  # years of backtracking; sre holds the GIL


CASE = Case(
    kind="gil_c_loop",
    simulates="a rank busy in a C loop holding the GIL (a catastrophic regular expression, "
              "a C extension that never releases it): 100 % CPU, its heartbeat thread starved",
    expect=Expect(category=("rank_stuck",), ranks=(1,), cause=("busy",)),
    fault=catastrophic_regex)
