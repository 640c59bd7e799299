"""Rank 1 is SIGKILLed in the all_reduce; rank 0 fails on the broken connection and aborts."""

from trainwatch.drill.corpus.case import Case, Context, Expect


def kill_self(ctx: Context) -> None:
    import os
    import signal
    os.kill(os.getpid(), signal.SIGKILL)


CASE = Case(
    kind="racing_deaths",
    simulates="racing deaths: one rank is killed, its peer dies of the broken connection "
              "(aborts, as NCCL's watchdog does) within the launcher's poll, which may name "
              "either",
    expect=Expect(category=("rank_dead",), ranks=(1,), cause=("SIGKILL",)),
    fault=kill_self, phase="allreduce", ends_job=True, abort_on_error=True,
    launcher_args=("--monitor-interval=3",))
