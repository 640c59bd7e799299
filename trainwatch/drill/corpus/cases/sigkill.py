"""Rank 1 is SIGKILLed mid-step."""

from trainwatch.drill.corpus.case import Case, Context, Expect


def kill_self(ctx: Context) -> None:
    import os
    import signal
    os.kill(os.getpid(), signal.SIGKILL)


CASE = Case(
    kind="sigkill",
    simulates="a rank SIGKILLed mid-step (a preempted or evicted process, kill -9)",
    expect=Expect(category=("rank_dead",), ranks=(1,), cause=("SIGKILL",)),
    fault=kill_self, ends_job=True)
