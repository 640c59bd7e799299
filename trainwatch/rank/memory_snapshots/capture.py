"""Copy a rank's state trees to reused host buffers in as few calls as possible.

A snapshot is taken every step, so what the loop waits for is mostly per-tensor Python
work, not bytes: the reference model's 113 tensors (1.5 MB) took 7.5 ms through
checkpoint/snapshot.py's chunked copies (made to share one large copy between two threads)
and 1.6 ms with one ``torch._foreach_copy_`` on a loaded 2-core VM. From a GPU the copies
go to pinned buffers on a side stream that first waits for the loop's work; one
synchronize of that stream ends the capture (the GPU path is written, not yet measured on a
GPU: docs/memory-snapshots.md).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from trainwatch.rank.checkpoint.snapshot import host_buffer

_PLAIN = (int, float, str, bool, bytes, type(None))


class HostCopy:
    """Host buffers kept between snapshots (a writer reads them until the next capture)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._stream: Any = None

    def capture(self, tree: Any) -> Any:
        """A copy of ``tree`` whose tensors are this object's host buffers."""
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        out = self._walk(tree, pairs)
        del self._buffers[len(pairs):]  # the state shrank: free what is unused
        host = [(d, s) for d, s in pairs if not s.is_cuda]
        if host:
            torch._foreach_copy_([d for d, _ in host], [s for _, s in host])
        cuda = [(d, s) for d, s in pairs if s.is_cuda]
        if cuda:
            self._from_cuda(cuda)
        return out

    def _from_cuda(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        self._stream.synchronize()

    def _walk(self, obj: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj.detach(), pairs)
        if isinstance(obj, dict):
            return type(obj)((k, self._walk(v, pairs)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(self._walk(v, pairs) for v in obj)
        if isinstance(obj, _PLAIN):
            return obj
        return copy.deepcopy(obj)

    def _tensor(self, tensor: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> torch.Tensor:
        if tensor.layout != torch.strided or tensor.is_quantized:
            return tensor.to("cpu", copy=True)  # rare layouts: no buffer reuse
        buf = host_buffer(self._buffers, len(pairs), tensor)
        pairs.append((buf, tensor))
        return buf
