"""Rank 1's main thread and a helper thread take two locks in opposite order."""

import threading

from trainwatch.drill.corpus.case import Case, Context, Expect

CACHE_LOCK, STATS_LOCK = threading.Lock(), threading.Lock()


def deadlock(ctx: Context) -> None:
    both_hold_one = threading.Barrier(2)  # makes the deadlock certain

    def refresh():
        with STATS_LOCK:
            both_hold_one.wait()
            with CACHE_LOCK:
                pass

    threading.Thread(target=refresh, name="cache-refresher", daemon=True).start()
    with CACHE_LOCK:
        both_hold_one.wait()
        with STATS_LOCK:
            pass


CASE = Case(
    kind="thread_deadlock",
    simulates="a lock-order deadlock between a rank's main thread and a helper thread",
    expect=Expect(category=("rank_stuck",), ranks=(1,), cause=("deadlock",)),
    fault=deadlock)
