"""Rank 1 takes a plain Lock it already holds."""

import threading

from trainwatch.drill.corpus.case import Case, Context, Expect

_EMA_LOCK = threading.Lock()


def update_ema(ctx: Context) -> None:
    with _EMA_LOCK:
        with _EMA_LOCK:  # the bug: a helper called under the lock takes it again
            pass


CASE = Case(
    kind="self_deadlock",
    simulates="a self-deadlock: one thread takes a plain (non-reentrant) Lock it holds",
    expect=Expect(category=("rank_stuck",), ranks=(1,), cause=("deadlock", "_EMA_LOCK")),
    fault=update_ema)
