"""A node of a multi-node job whose job ended because another node was stopped on request.

Ctrl-C or SIGTERM (``scancel``, ``systemctl stop``) on every node's ``trainwatch run`` stops
the job: the ranks agree a stop, save and exit. The nodes' signals never land at quite the
same moment: a node whose job ends before its own comes (the other node's ranks left, and
torchrun cannot go on without them) would see a failed job and restart it, or exit 1.
Its job ended for a stop the user asked for: it ends as stopped too (exit 130), naming the
node whose stop ended it, and is not restarted.

The evidence is another node's supervisor's stop on request, journaled after this node's
job started (the journal's order, not the nodes' clocks): ``controller_stopping``, which a
supervisor journals as a stop signal reaches it, before it signals its job (so before any
rank can leave for that stop); from a supervisor without it, ``job_stopped`` with reason
``interrupted`` or ``controller_stopped`` with ``interrupted``. A job that crashed has none:
it is restarted or fails as before. ``GRACE_SECONDS``: how long a failed job's node looks
again for that record before it decides (a shared filesystem may show another node's
append a moment late; an older supervisor journals its stop only once its job ended).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from trainwatch.rundir.run_dir import RunDir

STOPPING_EVENT = "controller_stopping"
INTERRUPTED = "interrupted"  # Role.interrupt_reason of ``trainwatch run``
GRACE_SECONDS = 2.0
POLL_SECONDS = 0.1


def stop_on_request(record: dict[str, Any]) -> bool:
    """Whether ``record`` is a supervisor's stop on request (a stop signal reached it)."""
    event = record.get("event")
    return (event == STOPPING_EVENT
            or (event == "job_stopped" and record.get("reason") == INTERRUPTED)
            or (event == "controller_stopped" and record.get("interrupted") is True))


def stopped_words(other: str) -> str:
    """What a node's ``trainwatch run`` says when ``other``'s stop ended its job."""
    return (f"the job ended as node {other} was stopped on request (its trainwatch run got "
            "a stop signal): this node stopped with it, not restarted")


def stopped_elsewhere(run: RunDir, node: str, pid: int) -> str | None:
    """The other node whose supervisor was stopped on request since this ``node`` started
    its job ``pid``, else None."""
    records = run.events()
    started = next((i for i in range(len(records) - 1, -1, -1)
                    if records[i].get("event") == "job_started"
                    and records[i].get("host") == node and records[i].get("pid") == pid), None)
    if started is None:  # its start is not in the journal (a full disk): nothing to go by
        return None
    for record in records[started + 1:]:
        other = record.get("host")
        if other and other != node and stop_on_request(record):
            return str(other)
    return None


def wait_stopped_elsewhere(run: RunDir, node: str, pid: int, *,
                           grace: float = GRACE_SECONDS,
                           clock: Callable[[], float] = time.monotonic,
                           sleep: Callable[[float], None] = time.sleep) -> str | None:
    """``stopped_elsewhere``, looked at again for up to ``grace`` seconds while it is None."""
    deadline = clock() + grace
    while True:
        why = stopped_elsewhere(run, node, pid)
        if why is not None or clock() >= deadline:
            return why
        sleep(POLL_SECONDS)
