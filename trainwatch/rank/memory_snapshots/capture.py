"""Copy a rank's state trees into one reused host buffer (the arena) in as few calls as possible.

A snapshot is taken every step, so what the loop waits for is mostly per-tensor Python
work, not bytes: the reference model's 113 tensors (1.5 MB) took 7.5 ms through
checkpoint/snapshot.py's chunked copies (made to share one large copy between two threads)
and 1.6 ms with one ``torch._foreach_copy_`` on a loaded 2-core VM. Every tensor's copy is
a view into ONE contiguous arena (each at a 64-byte aligned offset), so the writer thread
hashes and writes the whole state in one call each, calls that release the GIL
(payload.py): the loop's thread is not held while the bytes go to the tmpfs. The arena is
laid out anew only when the state's tensors change (shape, dtype, count); between two
layouts the walk is redone against the previous one (rewalk.py), checking each tensor's
shape and dtype at C speed where it can. From a GPU the
copies go to a pinned arena on a side stream that first waits for the loop's work; one
synchronize of that stream ends the capture (the GPU path is written, not yet measured on a
GPU: docs/memory-snapshots.md).
"""

from __future__ import annotations

import copy
from operator import attrgetter
from typing import Any

import torch

from trainwatch.rank.memory_snapshots import rewalk

_PLAIN = (int, float, str, bool, bytes, type(None))
ALIGN = 64
_SIZE, _DTYPE = torch.Tensor.size, attrgetter("dtype")


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class HostCopy:
    """The arena and its views, kept between snapshots (a writer reads them until the next
    capture). ``slots``: id of each view -> (offset, bytes) in ``arena``."""

    def __init__(self) -> None:
        self.arena: torch.Tensor = torch.empty(0, dtype=torch.uint8)
        self.slots: dict[int, tuple[int, int]] = {}
        self._views: list[torch.Tensor] = []
        self._stream: Any = None
        self._out: Any = None                      # the last walk's output (rewalk.py)
        self.frozen: dict[int, Any] = {}           # its containers kept as they are
        self.index_memo: dict[Any, Any] = {}       # their part of the index (payload.py)
        self._shapes: list[Any] = []
        self._dtypes: list[Any] = []
        self._host_only = True                     # no CUDA tensor when laid out

    def capture(self, tree: Any) -> Any:
        """A copy of ``tree`` whose tensors are views into this object's arena."""
        out, pairs = self.take(tree)
        self.copy(pairs)
        return out

    def take(self, tree: Any) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
        """``tree`` with its tensors replaced by their arena views, and the (view, source)
        pairs still to copy (``copy``; overlap.py copies some of them later)."""
        if self._out is not None:
            sources: list[torch.Tensor] = []
            try:
                out = rewalk.again(tree, self._out, self.frozen, self._views, sources)
                same = (len(sources) == len(self._views)
                        and list(map(_SIZE, sources)) == self._shapes
                        and list(map(_DTYPE, sources)) == self._dtypes)
            except (rewalk.Moved, AttributeError, TypeError):  # not shaped as before
                same = False
            if same:
                self._out = out
                return out, list(zip(self._views, sources))
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        missed: list[bool] = []
        out = self._walk(tree, pairs, missed)
        if missed or len(pairs) != len(self._views):  # the state changed: lay out anew
            self._layout([s for _, s in pairs])
            pairs, missed = [], []
            out = self._walk(tree, pairs, missed)
        self._remember(out, pairs)
        return out, pairs

    def reuse(self, out: Any, sources: list[torch.Tensor]) -> bool:
        """Take ``out`` (live.py's, built from the last walk's containers) with ``sources``
        as this snapshot's when they fit the arena's views one for one (count, shapes,
        dtypes: checked at C speed); False: walk the slow way."""
        if (len(sources) != len(self._views)
                or list(map(_SIZE, sources)) != self._shapes
                or list(map(_DTYPE, sources)) != self._dtypes):
            return False
        self._out = out
        return True

    def copy_all(self, sources: list[torch.Tensor]) -> None:
        """Copy ``sources`` into the views, one for one (``reuse``'s): one call for CPU ones."""
        if not self._host_only:
            self.copy(list(zip(self._views, sources)))
            return
        if sources:
            with torch.no_grad():  # the sources are not all detached (a module's parameters)
                torch._foreach_copy_(self._views, sources)

    def _remember(self, out: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """What the next walk is checked against (rewalk.py)."""
        self._out = out
        self.frozen = rewalk.frozen(out, lambda t: id(t) in self.slots)
        self.index_memo = {}
        self._shapes = [s.shape for _, s in pairs]
        self._dtypes = [s.dtype for _, s in pairs]
        self._host_only = not any(s.is_cuda for _, s in pairs)

    @property
    def layout(self) -> list[torch.Tensor]:
        """The arena's views: a new list object whenever the arena is laid out anew."""
        return self._views

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy the sources into their views: one call for the CPU ones."""
        if self._host_only:  # (a tensor moved to a GPU since: the same call, synchronous)
            if pairs:
                views, sources = zip(*pairs)
                with torch.no_grad():  # the sources are not all detached (rewalk.py)
                    torch._foreach_copy_(list(views), list(sources))
            return
        host = [(d, s) for d, s in pairs if not s.is_cuda]
        if host:
            with torch.no_grad():
                torch._foreach_copy_([d for d, _ in host], [s for _, s in host])
        cuda = [(d, s) for d, s in pairs if s.is_cuda]
        if cuda:
            self._from_cuda(cuda)

    def _layout(self, sources: list[torch.Tensor]) -> None:
        offsets, total = [], 0
        for src in sources:
            offsets.append(total)
            total = aligned(total + src.numel() * src.element_size())
        self._views, self.slots = [], {}
        self.arena = torch.empty(total, dtype=torch.uint8, device="cpu",
                                 pin_memory=any(s.is_cuda for s in sources))
        for src, offset in zip(sources, offsets):
            size = src.numel() * src.element_size()
            view = self.arena[offset:offset + size].view(src.dtype).view(src.shape)
            self._views.append(view)
            self.slots[id(view)] = (offset, size)

    def _from_cuda(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        self._stream.synchronize()

    def _walk(self, obj: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]],
              missed: list[bool]) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj.detach(), pairs, missed)
        if isinstance(obj, dict):
            out = type(obj)((k, self._walk(v, pairs, missed)) for k, v in obj.items())
            if hasattr(obj, "_metadata"):  # a module's state_dict: its versions, kept
                out._metadata = obj._metadata  # type: ignore[attr-defined]
            return out
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(self._walk(v, pairs, missed) for v in obj)
        if isinstance(obj, _PLAIN):
            return obj
        return copy.deepcopy(obj)

    def _tensor(self, tensor: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                missed: list[bool]) -> torch.Tensor:
        if tensor.layout != torch.strided or tensor.is_quantized:
            return tensor.to("cpu", copy=True)  # rare layouts: pickled, not in the arena
        i = len(pairs)
        view = self._views[i] if i < len(self._views) else None
        if view is None or view.shape != tensor.shape or view.dtype != tensor.dtype:
            missed.append(True)
            view = tensor  # a stand-in: the walk is redone on the new layout
        pairs.append((view, tensor))
        return view
