"""Which of several dead ranks failed first, as far as the ranks' own records order them.

torchrun checks its workers once per poll and stamps every failure it finds in that poll
with the same second; on a tie it names the lower rank its root cause, which need not be
the rank that died first. Only the ranks' own records order such deaths: the moment a
dying rank recorded its error, or a heartbeat of one still alive after another had failed.
One home for that decision: ``diagnose`` (diagnose/racing_deaths.py) and ``report``'s
incident cause (report/exit_order.py) both read it, so they never disagree on who was first.
Torch-free, standard library only.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from trainwatch.rundir.torchrun_log import PEER_FAILURE

# A rank's error that follows another's failure: a peer's failure seen from a collective,
# or the launcher's stop (the reference trainer's "Terminated: terminated by SIGTERM").
CONSEQUENCE = re.compile(PEER_FAILURE.pattern + r"|terminated by SIG|\bTerminated\b|"
                         r"SignalException")
# A dying rank records its error after the exception unwound: on a busy host a runnable
# process may wait a scheduler period (about 24 ms on CFS) first. Records closer than this
# do not order two failures.
RECORD_SLACK = 0.025
# Ranks on different nodes compare wall clocks, which NTP keeps within about this much.
CLOCK_SKEW = 1.0
DEFAULT_HEARTBEAT_INTERVAL = 1.0


@dataclass
class Death:
    """One rank that died on its own: how it ended, its own words, and the window its
    failure lies in (``earliest``..``latest``, Unix seconds) as far as its records say."""

    rank: int
    how: str
    words: str | None
    recorded_at: float | None  # when it recorded its own failure
    alive_at: float | None  # its last heartbeat, when it recorded no failure
    earliest: float
    latest: float
    node: str
    seen_with_root: bool  # torchrun saw it exit in the poll of its root cause
    interval: float  # its heartbeat interval


def death(rank: int, how: str, *, words: str | None, recorded_at: float | None,
          alive_at: float | None, node: str, seen_with_root: bool,
          interval: float = DEFAULT_HEARTBEAT_INTERVAL) -> Death:
    """A death with the window its records allow: just before its recorded error, else
    after its last heartbeat and before the next one was due, else any time at all."""
    if recorded_at is not None:
        window = (recorded_at - RECORD_SLACK, recorded_at)
        alive_at = None
    elif alive_at is not None:  # alive at its last beat, dead before the next one was due
        window = (alive_at, alive_at + interval + RECORD_SLACK)
    else:
        window = (float("-inf"), float("inf"))
    return Death(rank, how, words, recorded_at, alive_at, window[0], window[1], node,
                 seen_with_root, interval)


def allow_clock_skew(deaths: list[Death]) -> None:
    """Widen every window by the clock skew when the deaths are on several nodes (their
    wall clocks differ)."""
    if len({d.node for d in deaths}) > 1:
        for d in deaths:
            d.latest += CLOCK_SKEW


def first_of(deaths: list[Death]) -> tuple[Death | None, str]:
    """(the death that came first, why) when the records order it before every other one,
    else (None, why they cannot be ordered)."""
    for d in deaths:
        others = [o for o in deaths if o is not d]
        if all(d.latest < o.earliest for o in others):
            return d, "; ".join(_before(d, o) for o in others)
    recorded = sorted((d.recorded_at, d.rank) for d in deaths if d.recorded_at is not None)
    if len(recorded) == len(deaths):
        gap = recorded[-1][0] - recorded[0][0]
        return None, (f"their errors were recorded within {gap_text(gap)} of each other: too "
                      f"close to order (a dying rank records its error after it unwound, up "
                      f"to ~{RECORD_SLACK * 1000:.0f} ms late on a busy host)")
    silent = [d for d in deaths if d.recorded_at is None]
    beats = sorted(d.alive_at for d in silent if d.alive_at is not None)
    interval = max(d.interval for d in deaths)
    apart = (f", and their last heartbeats are {gap_text(beats[-1] - beats[0])} apart, about one "
             f"heartbeat interval ({interval:g} s) or less" if len(beats) == len(deaths) > 1
             else ", and no heartbeat shows one alive after another had failed")
    who = ("none of them" if len(silent) == len(deaths)
           else "rank " + ranks_text([d.rank for d in silent]))
    return None, (f"{who} recorded its failure with a time (an exit code or a signal leaves "
                  f"no record){apart}: the order they died in cannot be told")


def _before(first: Death, other: Death) -> str:
    if other.recorded_at is not None:
        return (f"rank {first.rank} recorded its error at {clock(first.recorded_at)}, "
                f"{gap_text(other.recorded_at - (first.recorded_at or 0))} before rank "
                f"{other.rank} recorded its own")
    if first.recorded_at is not None:
        return (f"rank {other.rank} was still alive (heartbeat at {clock(other.alive_at)}) "
                f"after rank {first.rank} recorded its error at {clock(first.recorded_at)}")
    return (f"rank {first.rank}'s heartbeat stopped at {clock(first.alive_at)}, more than one "
            f"heartbeat interval before rank {other.rank}'s last one ({clock(other.alive_at)})")


def ranks_text(ranks: list[int]) -> str:
    """``1 and 2``, ``0, 1 and 3``."""
    return (" and ".join(str(r) for r in ranks) if len(ranks) <= 2
            else ", ".join(str(r) for r in ranks[:-1]) + f" and {ranks[-1]}")


def clock(t: float | None) -> str:
    """A Unix time as the local clock's HH:MM:SS.mmm."""
    if t is None:
        return "?"
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


def gap_text(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"
