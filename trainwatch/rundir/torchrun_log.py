"""What torchrun's log says of its failed workers: each one's exit, and when it was seen.

torchrun prints a table of failed workers when a group ends ("time : 2026-12-04_19:09:45"
above each entry's rank, exit code and pid): the time it observed each failure (a poll, to
the second, in its local time), or the worker's own error-file time. Its "failed
(exitcode: ...)" line comes only after the others were stopped, which can be many seconds
later. Diagnose and report both date a death by this table.
"""

from __future__ import annotations

import datetime
import re
from typing import Any

# A rank's error that is a peer's failure seen from a collective (gloo: "Connection reset
# by peer", "closed by peer"), in the logs or the rank's recorded ``failure``: the rank that
# raised it followed the one that failed; diagnose and report name the other as the cause.
PEER_FAILURE = re.compile(r"reset by peer|closed by peer|Broken pipe")
# "failed (exitcode: -9) local_rank: 1 (pid: 4242)": a worker's exit code, local rank and pid.
FAILED_WORKER = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
# "Sending process 4242 closing signal SIGTERM": torchrun stopping a worker that had not
# exited on its own (after another failed, or on a stop).
CLOSING_SIGNAL = re.compile(r"Sending process (\d+) closing signal (\w+)")
# "monitor_interval         : 0.1" in torchrun's launch configs (logged at INFO).
MONITOR_INTERVAL = re.compile(r"^\s*monitor_interval\s*:\s*(\d+(?:\.\d+)?)\s*$", re.M)
_ENTRY_TIME = re.compile(r"time\s*:\s*(\S+)\s*\n(?:\s*host\s*:[^\n]*\n)?\s*rank\s*:[^\n]*\n"
                         r"\s*exitcode\s*:\s*-?\d+\s*\(pid:\s*(\d+)\)")


def failure_time(text: Any) -> float | None:
    """An entry's time (``2026-12-04_19:11:14``, torchrun's local time) as Unix seconds."""
    try:
        return datetime.datetime.fromisoformat(str(text).replace("_", "T")).timestamp()
    except ValueError:
        return None


def failure_times(text: str) -> dict[int, float]:
    """pid -> when torchrun saw that worker fail, for every entry of its failure tables."""
    found: dict[int, float] = {}
    for match in _ENTRY_TIME.finditer(text):
        when = failure_time(match[1])
        if when is not None:
            found.setdefault(int(match[2]), when)
    return found
