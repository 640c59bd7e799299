"""When torchrun saw its workers fail, from its failure table in a log.

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
