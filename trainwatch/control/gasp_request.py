"""Before a stall restart kills the ranks: ask the survivors for their step (a dying gasp).

A frozen or hung rank holds the others in a collective with the state of step N, the last
step every rank completed; the kill (SIGKILL) leaves them no teardown to write it in. So
the supervisor first writes ``RUN_DIR/control/gasp`` and waits at most ``WAIT_SECONDS``
for the answers (``control/gasp-answers/rank-NNNNN.json``, written by each rank's
telemetry thread after its gasp: rank/memory_snapshots/gasp_request.py). It asks only
when some rank keeps snapshots every K > 1 steps (with a snapshot every step there is
nothing to add) and waits only for the ranks whose heartbeat is fresh: a frozen rank's
has stopped, and it cannot answer. A multi-node job's leader asks once: the request and
the answers are in the shared run directory, read by every node's ranks, before the
repair request that has every node kill its ranks (control/repairs.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any, Callable

from trainwatch.contract.layout import (CONTROL_GASP, FORMAT_VERSION, GASP_ANSWERS_DIR,
                                        GASP_FORMAT, rank_file_name)
from trainwatch.rundir.atomic import atomic_write_json
from trainwatch.rundir.run_dir import RunDir

log = logging.getLogger(__name__)

WAIT_SECONDS = 5.0      # the longest a stall restart waits for the answers
POLL_SECONDS = 0.1
STALE_BEATS = 3         # a heartbeat older than this many intervals (and 2 s): no answer


def listeners(run: RunDir, now: float) -> tuple[list[int], list[int]]:
    """The ranks that keep snapshots every K > 1 steps: those whose heartbeat is fresh (they
    will answer) and those whose heartbeat stopped (frozen, or gone)."""
    fresh: list[int] = []
    stale: list[int] = []
    for status in run.statuses().records:
        rank = status.get("rank")
        memory = (status.get("checkpoint") or {}).get("memory_snapshots") or {}
        if not isinstance(rank, int) or not memory.get("enabled") \
                or not isinstance(memory.get("every_steps"), int) or memory["every_steps"] <= 1:
            continue
        beat, interval = status.get("heartbeat_at"), status.get("heartbeat_interval")
        limit = max(STALE_BEATS * (interval if isinstance(interval, (int, float)) else 1.0), 2.0)
        alive = isinstance(beat, (int, float)) and now - beat <= limit
        (fresh if alive else stale).append(rank)
    return sorted(fresh), sorted(stale)


def ask_survivors(run: RunDir, reason: str, *, wait: float = WAIT_SECONDS,
                  clock: Callable[[], float] = time.time,
                  sleep: Callable[[float], None] = time.sleep) -> dict[str, Any] | None:
    """Ask every rank for its gasp and wait for the fresh ones' answers (at most ``wait``
    seconds); journal the request and the answers. None: no rank would gasp."""
    fresh, stale = listeners(run, clock())
    if not fresh:
        return None
    number = _previous(run) + 1
    asked_at = clock()
    atomic_write_json(run.control_file(CONTROL_GASP), {
        "format": GASP_FORMAT, "version": FORMAT_VERSION, "kind": "request",
        "number": number, "time": asked_at, "reason": reason})
    run.append_event("gasp_requested", "engine", number=number, reason=reason,
                     waiting_for=fresh, not_answering=stale, wait_seconds=wait)
    answers: dict[int, dict[str, Any]] = {}
    while True:
        for rank in fresh:
            if rank not in answers:
                got = _answer(run, rank, number)
                if got is not None:
                    answers[rank] = got
        if len(answers) == len(fresh) or clock() - asked_at >= wait:
            break
        sleep(POLL_SECONDS)
    written = sorted({a["step"] for a in answers.values() if a.get("written")
                      and isinstance(a.get("step"), int)})
    summary = {"number": number, "seconds": round(clock() - asked_at, 3),
               "answers": [{k: answers[r].get(k) for k in ("rank", "step", "written", "why_not")}
                           for r in sorted(answers)],
               "missing": [r for r in fresh if r not in answers], "not_answering": stale,
               "steps_written": written}
    run.append_event("gasp_answered", "engine", **summary)
    log.warning("gasp request %d: %d of %d ranks answered in %.1f s, step(s) %s written",
                number, len(answers), len(fresh), summary["seconds"], written or "none")
    return summary


def _previous(run: RunDir) -> int:
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        number = json.loads(run.control_file(CONTROL_GASP).read_text()).get("number")
        if isinstance(number, int):
            return number
    return 0


def _answer(run: RunDir, rank: int, number: int) -> dict[str, Any] | None:
    path = run.control_dir / GASP_ANSWERS_DIR / rank_file_name(rank, ".json")
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != GASP_FORMAT \
            or doc.get("number") != number:
        return None  # none yet, or an earlier request's
    return doc
