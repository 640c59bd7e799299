"""Racing deaths: two or more ranks that died on their own, which one failed first only as
far as the ranks' own records can order them.

torchrun checks its workers once per poll (``--monitor-interval``: 0.1 s by default, 0.5 s
under ``trainwatch train``), stamps each failure it finds with the second it saw it (or
the second in the worker's error file) and names as its root cause the earliest stamp,
the lower rank on a tie. Two ranks that die within one poll get the same stamp: torchrun
then names the lower rank, which need not be the one that died first. A rank torchrun
stopped afterwards (its "Sending process N closing signal" line) or whose own error is a
peer's failure seen from a collective followed; the others died on their own, each for its
own cause. Only the ranks' own records order those: the moment a dying rank recorded its
error (its journal ``failed`` event, else its final ``failed`` status), or a heartbeat of
one still alive after another had failed.
"""

from __future__ import annotations

import signal
from typing import Any

from trainwatch.diagnose.casefile import Analysis
from trainwatch.diagnose.model import Evidence, Finding
from trainwatch.rundir.death_order import (CONSEQUENCE, DEFAULT_HEARTBEAT_INTERVAL, Death,
                                           allow_clock_skew, death, first_of, ranks_text)

TORCHRUN_POLL = 0.1  # torchrun's default --monitor-interval
_STOP_CODES = (-signal.SIGTERM, 128 + signal.SIGTERM)  # how torchrun's stop ends a worker


def own_deaths(a: Analysis, root: dict[str, Any] | None, failures: list[dict[str, Any]],
               own: list[int]) -> list[Death]:
    """The ranks that died on their own: torchrun's root cause, each failure it saw in the
    same second that it did not stop itself, and each rank that recorded an error of its
    own (``own``) — leaving out every rank whose own words are a consequence."""
    ev = a.ev
    stopped = set(ev.launcher.get("torn_down") or [])
    entries = {x["rank"]: x for x in ([root] if root else []) + failures
               if x.get("rank") in ev.ranks and x["rank"] not in a.explained}
    found = []
    for rank in sorted(set(entries) | set(own)):
        entry = entries.get(rank)
        words = own_words(ev, rank, entry)
        if words and CONSEQUENCE.search(words):
            continue
        same_poll = entry is not None and (entry is root or bool(
            root and entry.get("time") and entry.get("time") == root.get("time")
            and entry["pid"] not in stopped and entry["exitcode"] not in _STOP_CODES))
        if same_poll or (words and (entry is not None or rank in own)):
            found.append(_death(ev, rank, entry, words, same_poll,
                                entry is not None and entry["pid"] in stopped))
    allow_clock_skew(found)  # wall clocks of several nodes
    return found


def past_racers(ev: Evidence, root: dict[str, Any]) -> list[dict[str, Any]]:
    """An earlier attempt's deaths on their own in torchrun's poll of its root cause (its
    failure table): the root and each failure stamped the same second that torchrun did not
    stop and whose error in that attempt's log is not a consequence; in torchrun's order."""
    stopped = set(ev.launcher.get("torn_down") or [])
    errors = root.get("attempt_errors") or {}
    found = [root]
    for x in ev.launcher.get("failures") or []:
        words = errors.get(x.get("rank")) or errors.get(str(x.get("rank"))) or x.get("error")
        if x is not root and x.get("time") and x.get("time") == root.get("time") \
                and x.get("pid") not in stopped and x.get("exitcode") not in _STOP_CODES \
                and not (words and CONSEQUENCE.search(words)) \
                and not CONSEQUENCE.search(str(errors.get(root.get("rank")) or "")):
            found.append(x)
    return found


def own_words(ev: Evidence, rank: int, entry: dict[str, Any] | None) -> str | None:
    """The error a rank recorded itself: its status ``failure``, its journal ``failed``
    event, its first error line in the logs, or torchrun's error file of it."""
    view = ev.ranks[rank]
    failure = view.get("failure")
    message = failure.get("message") if isinstance(failure, dict) else None
    if isinstance(message, str) and message:
        return message
    event = _failed_event(ev, rank)
    if event and isinstance(event.get("error"), str):
        return event["error"]
    errors = ev.launcher.get("errors_by_rank") or {}
    line = errors.get(rank) or errors.get(str(rank))
    return line or (entry or {}).get("error") or None


def _failed_event(ev: Evidence, rank: int) -> dict[str, Any] | None:
    """The rank's newest journal ``failed`` event of its current process (not before the
    process started)."""
    started = ev.ranks[rank].get("started_at")
    events = [e for e in ev.journal.get("events") or [] if e.get("event") == "failed"
              and e.get("rank") == rank and _number(e.get("time")) is not None
              and (_number(started) is None or e["time"] >= started)]
    return events[-1] if events else None


def _death(ev: Evidence, rank: int, entry: dict[str, Any] | None, words: str | None,
           seen_with_root: bool, stopped: bool) -> Death:
    view = ev.ranks[rank]
    event = _failed_event(ev, rank)
    recorded = _number((event or {}).get("time"))
    if recorded is None and view.get("state") == "failed":  # its final status, at the failure
        recorded = _number(view.get("heartbeat_at"))
    beat = _number(view.get("heartbeat_at"))
    interval = _number(view.get("heartbeat_interval")) or DEFAULT_HEARTBEAT_INTERVAL
    how = exit_text(entry["exitcode"]) if entry else "its status says failed"
    if stopped:
        how += ", stopped by torchrun after its own error"
    return death(rank, how, words=words, recorded_at=recorded, alive_at=beat,
                 node=str(view.get("node")), seen_with_root=seen_with_root, interval=interval)


def racing_finding(a: Analysis, deaths: list[Death], root: dict[str, Any] | None,
                   followers: list[str], extra: dict[int, list[str]]) -> Finding:
    """The ranks that died on their own, each with its own cause; the first only when the
    records order it, torchrun's pick said for what it is."""
    ev = a.ev
    first, why = first_of(deaths)
    ranks = [d.rank for d in deaths]
    named = ranks_text(ranks)
    in_one_poll = root is not None and all(d.seen_with_root for d in deaths)
    causes = [f"rank {d.rank} ({d.how}): "
              + (f"its own error: {d.words[:200]}" if d.words else
                 "no error of its own in its status, the journal or the logs")
              for d in deaths]
    picked = _torchrun_pick(ev, root, in_one_poll)
    if first is not None:
        agrees = root is not None and root["rank"] == first.rank
        later = [r for r in ranks if r != first.rank]
        title = (f"rank {first.rank} failed first; rank{'s' if len(later) > 1 else ''} "
                 f"{ranks_text(later)} also died on {'their' if len(later) > 1 else 'its'} own")
        confidence = "high" if agrees or root is None else "medium"
        evidence = [a.where_line(first.rank), why] + causes
        if picked and not agrees:
            evidence.append(picked + f"; the ranks' own records order rank {first.rank} first. "
                            "Confidence medium: the launcher's order and the records disagree")
        culprits = [first.rank]
    else:
        title = (f"ranks {named} died on their own within one torchrun poll of each other: "
                 "which failed first cannot be told" if in_one_poll else
                 f"ranks {named} died on their own at about the same time: which failed "
                 "first cannot be told")
        confidence = "medium"
        evidence = [a.where_line(r) for r in ranks] + causes + ([picked] if picked else [])
        evidence.append(why + "; look at each rank's own cause")
        culprits = ranks
    for d in deaths:
        evidence += extra.get(d.rank, [])
    if followers:
        evidence.append("then the others followed (stopped by torchrun or failed in the "
                        "collective): " + ", ".join(followers))
    pattern = "|".join(str(r) for r in ranks)
    return Finding(
        "rank_dead", title, ranks=culprits, nodes=sorted({a.node(r) for r in culprits}),
        confidence=confidence, evidence=evidence, runbook="TrainingRankDown",
        next_command=(f"grep -n -E '^\\[(rank|default)({pattern})\\]' {ev.run_dir}/logs/*.log "
                      "| tail -n 40   # each rank's last words"))


def _torchrun_pick(ev: Evidence, root: dict[str, Any] | None, in_one_poll: bool) -> str:
    """What torchrun's root cause means here."""
    if root is None:
        return ""
    named = f"torchrun names rank {root['rank']} its root cause (first observed failure)"
    stamp = root.get("time") or "to the second"
    if in_one_poll:
        return (f"{named} because it saw these exits in the same poll ({poll_text(ev)}), all "
                f"stamped {stamp}, and on a tie it takes the lower rank: that need not be the "
                "rank that died first")
    return (f"{named}: the first process it saw exit (stamped {stamp}); a rank still writing "
            "its own error then exits later, so that need not be the rank that failed first")


def poll_text(ev: Evidence) -> str:
    """How often torchrun polled its workers, as far as the run says."""
    hosts = (ev.journal.get("launchers") or {}).get("hosts") or []
    known = [h["monitor_interval"] for h in hosts if h.get("monitor_interval")]
    interval = ev.launcher.get("monitor_interval") or (max(known) if known else None)
    if interval:
        return f"it checks its workers every {interval:g} s"
    return f"it checks its workers every --monitor-interval, {TORCHRUN_POLL:g} s by default"


def exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None
