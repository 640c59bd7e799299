"""A snapshot every step without ``state_dict()``: the live tensors, once the layout is known.

At the reference model the loop's thread spent ~0.23 ms of its ~0.9 ms per snapshot in
``model.state_dict()`` and ``optimizer.state_dict()`` (torch's Python: 27 modules walked,
113 tensors detached) and ~0.13 ms walking their output against the previous walk
(rewalk.py), every step, to find the same tensors again. Once a layout is known, what those
calls would return is known too: the module's parameters and persistent buffers, the
optimizer's state tensors, in their order. So after a snapshot taken the slow way,
``learn`` writes down, for each ``torch.nn.Module`` and ``torch.optim.Optimizer`` of the
state, its live tensors and the objects whose identity says they are still the ones — and
keeps that plan only if replaying it reproduces the slow walk's tensors one for one (same
storage, offset, shape, stride, dtype, in the same order). ``take`` then checks, at C speed,
only what could make the plan wrong:

* a module: every module's ``_parameters``, ``_buffers`` and ``_modules`` hold the same
  objects under the same names (a parameter replaced, a buffer or module added or removed),
  the same non-persistent buffer names, no ``state_dict`` hook registered since; a
  parameter whose ``.data`` was replaced is read through the same ``Parameter`` object,
  and its shape and dtype are checked against the arena's as every step's are (capture.py);
* an optimizer: the same param groups holding the same parameters, its ``state`` keyed by
  the same parameters holding the same tensor objects under the same names (state created
  lazily at its first step, a new param group, a tensor replaced), no state-dict hook; the
  groups' other values (learning rate, betas, ...) are read again every step, plain values
  only (anything else: the slow way);
* anything else of the state (a scheduler, the data position) is asked for its
  ``state_dict()`` every step and walked as before.

Any doubt (a check fails, an object of another kind or type overriding ``state_dict``,
hooks, non-tensor optimizer state, sharded state) takes the slow way for that snapshot; a
changed layout is learned again from it.
"""

from __future__ import annotations

from itertools import chain
from operator import attrgetter, is_, itemgetter
from typing import Any, Callable

import torch
from torch.nn import Module
from torch.optim import Optimizer

from trainwatch.rank.memory_snapshots import rewalk
from trainwatch.rank.memory_snapshots.capture import HostCopy

_FLAT = frozenset({int, float, str, bool, complex, type(None)})
_VALUES = dict.values
_PARAMS, _BUFFERS, _MODULES = attrgetter("_parameters"), attrgetter("_buffers"), attrgetter("_modules")
_HOOKS = attrgetter("_state_dict_hooks", "_state_dict_pre_hooks")
_NON_PERSISTENT = attrgetter("_non_persistent_buffers_set")
_GROUP_PARAMS = itemgetter("params")


class Live:
    """What ``after_step`` may read the state from instead of ``state()``: the objects
    (``name -> object``, as ``Checkpoints.maybe_save`` is given them) and ``trees``, which
    turns a dict of some of them into their state trees exactly as ``state()`` would."""

    __slots__ = ("objects", "trees")

    def __init__(self, objects: dict[str, Any], trees: Callable[[dict[str, Any]], dict[str, Any]]):
        self.objects = objects
        self.trees = trees


def _same(a: list[Any], b: list[Any]) -> bool:
    """The same objects, in the same order (identity: never a tensor's ``==``)."""
    return len(a) == len(b) and all(map(is_, a, b))


class _ModulePlan:
    """A module's state_dict as its live tensors; ``check`` says it still holds."""

    def __init__(self, module: Module):
        self.modules: list[Module] = []
        self.tensors: list[torch.Tensor] = []
        self.keys: list[str] = []

        def visit(m: Module, prefix: str) -> None:
            self.modules.append(m)
            for name, p in m._parameters.items():
                if p is not None:
                    self.keys.append(prefix + name)
                    self.tensors.append(p)
            for name, b in m._buffers.items():
                if b is not None and name not in m._non_persistent_buffers_set:
                    self.keys.append(prefix + name)
                    self.tensors.append(b)
            for name, child in m._modules.items():
                if child is not None:
                    visit(child, prefix + name + ".")

        visit(module, "")
        # the containers looked at every step, listed once (a module's own dicts: that one
        # is replaced wholesale is not looked for, only what they hold)
        self.dicts: list[dict[str, Any]] = [*map(_PARAMS, self.modules),
                                             *map(_BUFFERS, self.modules),
                                             *map(_MODULES, self.modules)]
        self.hooks: list[Any] = list(chain.from_iterable(map(_HOOKS, self.modules)))
        self.persistence: list[Any] = list(map(_NON_PERSISTENT, self.modules))
        self.members = list(chain.from_iterable(map(_VALUES, self.dicts)))
        self.names = list(chain.from_iterable(self.dicts))
        self.non_persistent = list(map(len, self.persistence))

    def plain(self) -> bool:
        """No module does anything ``state_dict`` would not (overrides, extra state, hooks)."""
        for m in self.modules:
            kind = type(m)
            if (kind.state_dict is not Module.state_dict
                    or kind._save_to_state_dict is not Module._save_to_state_dict
                    or getattr(kind, "get_extra_state", Module.get_extra_state)
                    is not Module.get_extra_state
                    or m._state_dict_hooks or m._state_dict_pre_hooks):
                return False
        return True

    def check(self) -> bool:
        return (_same(list(chain.from_iterable(map(_VALUES, self.dicts))), self.members)
                and list(chain.from_iterable(self.dicts)) == self.names
                and not any(map(len, self.hooks))
                and list(map(len, self.persistence)) == self.non_persistent)


class _OptimizerPlan:
    """An optimizer's state_dict: its state tensors live, its groups' values read again."""

    def __init__(self, optimizer: Optimizer):
        self.optimizer = optimizer
        self.groups = optimizer.param_groups
        self.params = list(chain.from_iterable(map(_GROUP_PARAMS, self.groups)))
        self.indices: list[list[int]] = []
        mapping: dict[int, int] = {}
        start = 0
        for group in self.groups:  # as Optimizer.state_dict's pack_group numbers them
            for i, p in enumerate(group["params"], start):
                mapping.setdefault(id(p), i)
            self.indices.append([mapping[id(p)] for p in group["params"]])
            start += len(group["params"])
        self.keys = list(optimizer.state)
        self.state_dicts = list(optimizer.state.values())
        self.names = list(chain.from_iterable(self.state_dicts))
        self.tensors = list(chain.from_iterable(map(_VALUES, self.state_dicts)))
        self.packed_keys = [mapping.get(id(k)) for k in self.keys]

    def plain(self) -> bool:
        opt = self.optimizer
        return (type(opt).state_dict is Optimizer.state_dict
                and not opt._optimizer_state_dict_pre_hooks
                and not opt._optimizer_state_dict_post_hooks
                and None not in self.packed_keys
                and all(type(s) is dict for s in self.state_dicts)
                and all(isinstance(t, torch.Tensor) for t in self.tensors)
                and self.param_groups() is not None)

    def check(self) -> bool:
        opt = self.optimizer
        state = opt.state
        return (opt.param_groups is self.groups and len(self.groups) == len(self.indices)
                and _same(list(chain.from_iterable(map(_GROUP_PARAMS, self.groups))), self.params)
                and _same(list(state), self.keys)
                and _same(list(state.values()), self.state_dicts)
                and list(chain.from_iterable(self.state_dicts)) == self.names
                and _same(list(chain.from_iterable(map(_VALUES, self.state_dicts))), self.tensors)
                and not opt._optimizer_state_dict_pre_hooks
                and not opt._optimizer_state_dict_post_hooks)

    def param_groups(self) -> list[dict[str, Any]] | None:
        """The groups as ``state_dict`` packs them (params last, as indices), their values
        plain (a tuple of plain values at most), or None."""
        out = []
        for group, indices in zip(self.groups, self.indices):
            packed = {k: v for k, v in group.items() if k != "params"}
            for v in packed.values():
                kind = type(v)
                if kind not in _FLAT and (kind is not tuple or not set(map(type, v)) <= _FLAT):
                    return None
            packed["params"] = list(indices)
            out.append(packed)
        return out


class LiveTrees:
    """``learn`` a plan from a snapshot taken the slow way; ``take`` by it while it holds."""

    def __init__(self) -> None:
        self._plan: list[tuple[str, str, Any]] | None = None
        self._objects: list[Any] = []
        self._names: list[str] = []
        self._rest: list[str] = []   # asked for their trees every step (and "data")
        self._layout: Any = None
        self.fast_total = 0   # snapshots taken by the plan (tests, benchmarks)

    @property
    def planned(self) -> bool:
        return self._plan is not None

    def forget(self) -> None:
        self._plan = None

    def learn(self, live: Live, host: HostCopy, trees: dict[str, Any],
              sources: list[torch.Tensor]) -> None:
        """After a slow take of ``trees`` (whose tensors, in walk order, are ``sources``):
        keep a plan only if replaying it gives back those tensors."""
        self._plan = None
        names = [k for k in trees if k != "data"]
        if list(live.objects) != list(trees) or host._out is None:
            return
        plan: list[tuple[str, str, Any]] = []
        for name in names:
            obj = live.objects[name]
            if isinstance(obj, Module):
                part: Any = _ModulePlan(obj)
                if (not part.plain() or list(trees[name]) != part.keys
                        or id(host._out.get(name)) not in host.frozen):
                    return
                plan.append((name, "module", part))
            elif isinstance(obj, Optimizer):
                part = _OptimizerPlan(obj)
                tree, out = trees[name], host._out.get(name)
                if (not part.plain() or type(tree) is not dict
                        or list(tree) != ["state", "param_groups"]
                        or list(tree["state"]) != part.packed_keys
                        or tree["param_groups"] != part.param_groups()
                        or type(out) is not dict or id(out.get("state")) not in host.frozen):
                    return
                plan.append((name, "optimizer", part))
            else:
                plan.append((name, "other", None))
        self._plan, self._names = plan, list(live.objects)
        self._rest = [n for n in self._names
                      if n == "data" or all(n != m or kind == "other" for m, kind, _ in plan)]
        self._objects = list(live.objects.values())
        self._layout = host.layout
        replayed = self.take(live, host, learning=True)
        if replayed is None or not _alike(replayed[1], sources):
            self._plan = None

    def take(self, live: Live, host: HostCopy, *, learning: bool = False
             ) -> tuple[dict[str, Any], list[torch.Tensor], Any] | None:
        """(the output tree, the sources in the arena's order, the data tree) by the plan, or
        None: take it the slow way. The sources' shapes and dtypes are the caller's to check."""
        plan, prev = self._plan, host._out
        if plan is None or prev is None or host.layout is not self._layout:
            return None
        objects = live.objects
        if not _same(list(objects.values()), self._objects) or list(objects) != self._names:
            return None
        rest_trees = live.trees({name: objects[name] for name in self._rest}) if self._rest else {}
        out: dict[str, Any] = {}
        sources: list[torch.Tensor] = []
        views = host.layout
        try:
            for name, kind, part in plan:
                if kind == "module":
                    if not part.check():
                        return None
                    sources.extend(part.tensors)
                    out[name] = prev[name]
                elif kind == "optimizer":
                    if not part.check():
                        return None
                    groups = part.param_groups()
                    if groups is None:
                        return None
                    sources.extend(part.tensors)
                    out[name] = {"state": prev[name]["state"], "param_groups": groups}
                else:
                    out[name] = rewalk.again(rest_trees[name], prev.get(name), host.frozen,
                                             views, sources)
        except (rewalk.Moved, AttributeError, TypeError, KeyError):
            return None
        if not learning:
            self.fast_total += 1
        return out, sources, rest_trees.get("data")


def _alike(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """The same tensors' memory, one for one: storage, offset, shape, stride, dtype."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if (x.data_ptr() != y.data_ptr() or x.shape != y.shape or x.stride() != y.stride()
                or x.dtype != y.dtype or x.device != y.device):
            return False
    return True
