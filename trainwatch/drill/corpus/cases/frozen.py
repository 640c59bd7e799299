"""Rank 1's whole process is stopped (SIGSTOP)."""

from trainwatch.drill.corpus.case import Case, Context, Expect


def stop_self(ctx: Context) -> None:
    import os
    import signal
    os.kill(os.getpid(), signal.SIGSTOP)


CASE = Case(
    kind="frozen",
    simulates="a frozen rank: the whole process stops (SIGSTOP; a frozen host, a wedged "
              "driver), heartbeats stop too",
    expect=Expect(category=("rank_stuck",), ranks=(1,), cause=("stopped",)),
    fault=stop_self)
