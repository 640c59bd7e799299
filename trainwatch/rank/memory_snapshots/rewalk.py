"""Walk a state again the cheap way: against the previous walk's output, not anew.

A snapshot every step walks the same trees every step: the reference model's 113 tensors
in ~190 containers took ~0.26 ms of the loop's Python per snapshot (capture.py's walk,
rebuilding every container). Between two snapshots the trees are mostly the same: the
same keys, the same tensors (new ``detach``ed objects of the same storages: ``state_dict``
makes them anew). So the previous output's *frozen* containers — dicts whose leaves are
all arena tensors, e.g. a model's state_dict or an optimizer's per-parameter state — are
kept, and the walk again only checks their keys (``tuple(d)``, C speed) and gathers their
tensors in order (``d.values()``); every other container is rebuilt as capture.py's walk
would, so a value that moves (a learning rate) is this step's. What the caller still checks
is each gathered tensor's shape and dtype against the arena's (capture.py); anything else
that does not match raises ``Moved``: walk anew.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

_PLAIN = (int, float, str, bool, bytes, type(None))
_FLAT = {int, float, str, bool, bytes, complex, type(None)}

# a frozen container's spec: the keys (a tuple) of a dict of arena tensors, or
# [keys, child specs] for a dict of frozen dicts
Spec = Any


class Moved(Exception):
    """The tree is not shaped as the previous walk's: walk it anew."""


def frozen(out: Any, in_arena: Any) -> dict[int, Spec]:
    """id -> spec of every frozen dict in ``out`` (a walk's output); ``in_arena(t)``: the
    tensor is an arena view (not a loose copy)."""
    found: dict[int, Spec] = {}

    def spec(node: Any) -> Spec | None:
        if isinstance(node, dict):
            values = list(node.values())
            if values and all(isinstance(v, torch.Tensor) and in_arena(v) for v in values):
                found[id(node)] = tuple(node)
                return found[id(node)]
            subs = [spec(v) for v in values]
            if values and all(s is not None and not hasattr(v, "_metadata")
                              for s, v in zip(subs, values)):
                found[id(node)] = [tuple(node), subs]
                return found[id(node)]
            return None
        if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
            for v in node:
                spec(v)
        return None

    spec(out)
    return found


def gather(obj: Any, spec: Spec, sources: list[torch.Tensor]) -> None:
    """Append the tensors of ``obj``, shaped as ``spec`` says, to ``sources``."""
    if type(spec) is tuple:
        if tuple(obj) != spec:
            raise Moved
        sources.extend(obj.values())
        return
    keys, subs = spec
    if tuple(obj) != keys:
        raise Moved
    for value, sub in zip(obj.values(), subs):
        gather(value, sub, sources)


def again(obj: Any, prev: Any, frozen_ids: dict[int, Spec], views: list[torch.Tensor],
          sources: list[torch.Tensor]) -> Any:
    """``obj`` walked against ``prev``, the previous output: its frozen containers returned
    as they are (their tensors appended to ``sources``), the rest rebuilt."""
    spec = frozen_ids.get(id(prev))
    if spec is not None:
        if type(obj) is not type(prev):
            raise Moved
        gather(obj, spec, sources)
        if hasattr(obj, "_metadata"):  # a module's state_dict: its versions, this step's
            prev._metadata = obj._metadata
        return prev
    if isinstance(obj, torch.Tensor):
        i = len(sources)
        if i >= len(views) or prev is not views[i]:
            raise Moved  # a new tensor, or one of a rare layout (copied apart)
        sources.append(obj)
        return prev
    if isinstance(obj, dict):
        if type(prev) is not type(obj):
            raise Moved
        out = type(obj)((k, again(v, prev.get(k), frozen_ids, views, sources))
                        for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        if not set(map(type, obj)) - _FLAT:  # plain values only: copied at C speed
            return type(obj)(obj)
        if type(prev) is not type(obj) or len(prev) != len(obj):
            raise Moved
        return type(obj)(again(v, p, frozen_ids, views, sources) for v, p in zip(obj, prev))
    if isinstance(obj, _PLAIN):
        return obj
    return copy.deepcopy(obj)
