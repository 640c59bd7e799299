"""The ranks torchrun saw die in an attempt, in the order that is known and no other.

torchrun's failure table lists the workers it found dead in one poll, all stamped with the
same second, and names the lower rank its root cause on a tie: its order is not the order
they died in. An incident's cause lists them in torchrun's order only when its stamps
differ; within one poll it names a first only where the ranks' own records (their journal
``failed`` events) order it (rundir/death_order.py, the rule ``diagnose`` uses too), and
otherwise says that which failed first is not known.
"""

from __future__ import annotations

from typing import Any

from trainwatch.rundir.death_order import (CONSEQUENCE, allow_clock_skew, death, first_of,
                                           ranks_text)


def how_it_ended(x: dict[str, Any]) -> str:
    """``killed by SIGKILL``, ``exited with code 1``."""
    return f"killed by {x['signal']}" if x["signal"] else f"exited with code {x['exitcode']}"


def exits_text(exits: list[dict[str, Any]], errors: list[dict[str, Any]]) -> list[str]:
    """The cause's parts for the ranks torchrun saw die (non-zero exits), torchrun's order
    said for what it is."""
    died = [x for x in exits if x["exitcode"] != 0]
    words = {e["rank"]: e["error"] for e in errors if e.get("error")}
    own = [x for x in died if not CONSEQUENCE.search(words.get(x["rank"], ""))]
    stamps = {x.get("seen_at") for x in own}
    # A rank whose own error is a peer's failure seen from a collective followed the others.
    after = [f"rank {x['rank']} {how_it_ended(x)} after a peer's failure"
             for x in died if x not in own]
    if len(own) < 2 or (None not in stamps and len(stamps) == len(own)):
        return [f"rank {x['rank']} {how_it_ended(x)}" for x in own] + after
    deaths = [death(x["rank"], how_it_ended(x), words=words.get(x["rank"]),
                    recorded_at=x.get("recorded_at"), alive_at=None,
                    node=str(x.get("host")), seen_with_root=True) for x in own]
    allow_clock_skew(deaths)
    first, why = first_of(deaths)
    if first is not None:
        rest = sorted((d for d in deaths if d is not first), key=lambda d: d.rank)
        parts = [f"rank {first.rank} {first.how} first ({why})"] + [
            f"rank {d.rank} {d.how}, also on its own" for d in rest]
    else:
        ranks = sorted(deaths, key=lambda d: d.rank)
        one_poll = "within one torchrun poll" if len(stamps) == 1 and None not in stamps \
            else "at about the same time"
        parts = [f"ranks {ranks_text([d.rank for d in ranks])} died {one_poll} ("
                 + ", ".join(f"rank {d.rank} {d.how}" for d in ranks)
                 + "); which failed first is not known from torchrun"
                 + ("" if any(d.recorded_at is not None for d in ranks) else
                    " nor from the ranks' own records")]
    return parts + after
