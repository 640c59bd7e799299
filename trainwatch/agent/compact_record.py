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
        return value if depth > 32 else _compact_dict(value, depth)
    if isinstance(value, list):
        if depth > 32 or set(map(type, value)) <= _SCALARS \
                or not any(isinstance(v, (dict, list, str)) for v in value):
            return value  # a list of numbers (a job summary's middle) stays the list parsed
        return [compact(v, depth + 1) for v in value]
    if type(value) is str and len(value) <= SHARED_TEXT:
        return sys.intern(value)
    return value


# Types a parse makes that are kept as they are: a dict's numbers, flags and nulls are
# taken without a call each, and a list of only these is looked at in one pass (in C).
_SCALARS = frozenset({float, int, bool, type(None)})


def _compact_dict(value: dict[Any, Any], depth: int) -> dict[Any, Any]:
    """``compact`` of a dict: a call per value had been half the cost of a parsed status
    (~60 values, most of them numbers and short words)."""
    intern, scalars, deeper = sys.intern, _SCALARS, depth + 1
    out = {}
    for key, item in value.items():
        if type(key) is str:
            key = intern(key)
        kind = type(item)
        if kind in scalars:
            out[key] = item
        elif kind is str:
            out[key] = intern(item) if len(item) <= SHARED_TEXT else item
        else:
            out[key] = compact(item, deeper)
    return out
