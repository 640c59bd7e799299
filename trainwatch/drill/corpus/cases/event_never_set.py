"""Rank 1 waits for a threading.Event nothing sets."""

import threading

from trainwatch.drill.corpus.case import Case, Context, Expect

PREFETCH_READY = threading.Event()


def wait_for_prefetch(ctx: Context) -> None:
    PREFETCH_READY.wait()  # the bug: the thread that sets it was never started


CASE = Case(
    kind="event_never_set",
    simulates="a rank waits for an event nothing sets (a producer thread that died or never "
              "started)",
    expect=Expect(category=("rank_stuck",), ranks=(1,), cause=("event",)),
    fault=wait_for_prefetch)
