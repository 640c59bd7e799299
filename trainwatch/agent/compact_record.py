"""A parsed status made compact for the time the agent keeps it (seconds, every rank).

``json.loads`` makes every key of every object a string of its own, and each status
the agent holds (one per local rank, parsed again every few seconds) has ~60 keys and
a few short words (state, phase, backend, node): ~4 KiB a rank of strings that are the
same in every status. Shared (``sys.intern``) they are held once. Values and structure
are unchanged: the record compares equal and serializes the same.
"""

from __future__ import annotations

import sys
from typing import Any

SHARED_TEXT = 64  # string values up to this long are shared (words, names, not messages)


def compact(value: Any, depth: int = 0) -> Any:
    """``value`` with its dicts' keys and short string values shared; lists and dicts
    are rebuilt, anything else is itself. Nesting past 32 levels is left as parsed."""
    if isinstance(value, dict):
        if depth > 32:
            return value
        intern = sys.intern
        return {intern(k) if type(k) is str else k: compact(v, depth + 1)
                for k, v in value.items()}
    if isinstance(value, list):
        if depth > 32 or not any(isinstance(v, (dict, list, str)) for v in value):
            return value  # a list of numbers (a job summary's middle) stays the list parsed
        return [compact(v, depth + 1) for v in value]
    if type(value) is str and len(value) <= SHARED_TEXT:
        return sys.intern(value)
    return value
