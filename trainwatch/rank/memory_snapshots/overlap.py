"""Copy a large snapshot into the arena beside the next step's forward and backward.

At 289 MB of state the copy into host memory took ~0.13 s on the loop's thread at every
snapshot (memory bandwidth). The state a snapshot holds (the parameters, the optimizer's
state) changes at the optimizer's step, not in the forward or the backward: so the copy of
a state of ``OVERLAP_BYTES`` or more runs on the writer thread (``torch._foreach_copy_``
releases the GIL) while the loop goes on, and the loop blocks only where the state would
change under it: a global optimizer pre-step hook (any ``torch.optim`` optimizer, the
dying gasp's kind) waits for the copy to end. Only an optimizer's own tensors are copied
so — its parameters and its state, learned from the optimizers whose hook runs in the step
after each new layout's first snapshot, which is copied whole at the boundary — because
only their changes come at the optimizer's step and bump their version counters: BatchNorm
updates its running mean and variance in the forward without bumping theirs (torch 2.13).

That the copied tensors stayed as they were is checked, never assumed: their version
counters (every in-place change bumps them) must still be those of the step's end when the
loop next stands outside the copy — that hook, or the next snapshot's step boundary, or
``close`` — and only then is the snapshot sealed; else it is dropped and counted, never
written as a mix of two steps, and the tensors that changed are copied at the step
boundary from then on (as are those seen changing before the learning step's hook).
So a snapshot is sealed when the next step's optimizer step begins, not when its write
ends (docs/memory-snapshots.md). CUDA tensors keep capture.py's path (a pinned arena, a
side stream, synchronized at the boundary): overlapping them (an event the hook waits on)
is not done.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

OVERLAP_BYTES = 16 << 20   # below this the copy takes ~1 ms: done at the boundary
Pairs = list[tuple[torch.Tensor, torch.Tensor]]


class Overlap:
    """One rank's overlapped copies: ``split`` at the boundary, ``copy`` on the writer
    thread, ``settle`` from the loop (the hook, the next boundary, close), ``sealable`` on
    the writer thread before it seals."""

    def __init__(self, min_bytes: int | None = None):
        self.min_bytes = OVERLAP_BYTES if min_bytes is None else min_bytes
        self._lock = threading.Lock()
        self._copied = threading.Event()
        self._settled = threading.Event()
        self._settled.set()
        self._pending = False
        self._ok = True
        self._sources: list[torch.Tensor] = []
        self._versions: list[int] = []
        self._later: set[int] = set()
        self._now: set[int] | None = None  # indices copied at the boundary; None: not learned
        self._layout: Any = None
        self._bytes = 0            # the layout's host bytes
        self._owned: set[int] = set()  # storages of the optimizers' parameters and state
        self._learning = False
        self._hook: Any = None
        self.dropped_total = 0  # snapshots not sealed: their tensors changed during the copy
        self.last_changed: list[int] = []

    def split(self, pairs: Pairs, layout: Any) -> tuple[Pairs, Pairs]:
        """(copy now, copy later) for this snapshot's (arena view, source) pairs, and the
        check armed for what is copied later. ``layout``: the arena's identity (a new one
        means new tensors: relearn)."""
        if layout is not self._layout:  # (a layout's tensors keep their shapes: sized once)
            self._layout, self._now, self._owned = layout, None, set()
            self._bytes = sum(s.numel() * s.element_size() for _, s in pairs if not s.is_cuda)
        self._learning = self._now is None
        if self._bytes < self.min_bytes:
            return pairs, []
        if self._hook is None:
            self._hook = register_optimizer_step_pre_hook(self._stepping)
        now_set = self._now
        owned = self._owned
        later = set() if now_set is None else {
            i for i, (_, s) in enumerate(pairs) if i not in now_set and not s.is_cuda
            and s.untyped_storage().data_ptr() in owned}
        with self._lock:
            self._sources = [s for _, s in pairs]
            self._versions = [s._version for s in self._sources]
            self._later = later
            self._ok = True
            self._pending = True
            self._copied.clear()
            self._settled.clear()
            if not later:
                self._copied.set()
        return ([p for i, p in enumerate(pairs) if i not in later],
                [p for i, p in enumerate(pairs) if i in later])

    def whole(self, layout: Any) -> bool:
        """True when this known layout is copied whole at the boundary (below the bytes
        that ``split`` defers): no pairs to split, no check to arm."""
        return layout is self._layout and self._bytes < self.min_bytes

    def copy(self, later: Pairs) -> None:
        """The writer thread: the deferred copy (releases the GIL), then says it is done."""
        try:
            if later:
                with torch.no_grad():  # the sources are not all detached (rewalk.py)
                    torch._foreach_copy_([d for d, _ in later], [s for _, s in later])
        finally:
            self._copied.set()

    def settle(self) -> None:
        """The loop, outside any copy of its own: wait for the deferred copy, then compare
        the version counters with the step's end. Idempotent; nothing to do when idle."""
        with self._lock:
            if not self._pending:
                return
            self._copied.wait()
            changed = [i for i, (s, v) in enumerate(zip(self._sources, self._versions))
                       if s._version != v]
            self.last_changed = [i for i in changed if i in self._later]
            self._ok = not self.last_changed
            if self._now is None:   # the first check of a layout: learn what moves early
                self._now = set(changed)
            else:
                self._now |= set(changed)
            if not self._ok:
                self.dropped_total += 1
            self._sources, self._pending = [], False
            self._settled.set()

    def sealable(self) -> bool:
        """The writer thread, its bytes written: True when the copy held the step's state.
        A snapshot copied whole at the boundary is sealable at once (its check only learns)."""
        if not self._later:
            return True
        self._settled.wait()
        return self._ok

    def abandon(self) -> None:
        """The snapshot armed by ``split`` will not be copied (its capture failed)."""
        with self._lock:
            self._sources, self._later, self._pending = [], set(), False
            self._copied.set()
            self._settled.set()

    def _stepping(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._learning:  # the step after a layout's first snapshot: whose tensors?
            self._owned |= _storages(optimizer)
        self.settle()

    def close(self) -> None:
        self.settle()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def _storages(optimizer: Any) -> set[int]:
    """The storages of an optimizer's parameters and state tensors."""
    out = set()
    for group in getattr(optimizer, "param_groups", []):
        for p in group.get("params", []):
            if isinstance(p, torch.Tensor):
                out.add(p.untyped_storage().data_ptr())
    for state in getattr(optimizer, "state", {}).values():
        for v in state.values() if isinstance(state, dict) else ():
            if isinstance(v, torch.Tensor):
                out.add(v.untyped_storage().data_ptr())
    return out
