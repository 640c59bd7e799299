"""Copy a training-state tree to host memory, quickly, so the loop can move on.

The copy is the only part of an async save the loop waits for.  Host buffers are kept
and reused (at most one save is in flight, so the previous copy is free again), which
spares an allocation of the whole state per save; from a GPU the copies go to pinned
memory without blocking, and one synchronize waits for them all; on the CPU they are
plain memcpys.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch


class HostSnapshot:
    """Reusable host buffers for the tensors of one state tree."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._index = 0
        self._from_cuda = False

    def capture(self, tree: Any) -> Any:
        """A copy of ``tree`` whose tensors live in this snapshot's host buffers."""
        self._index = 0
        self._from_cuda = False
        out = self._copy(tree)
        del self._buffers[self._index:]  # the state shrank: free what is unused
        if self._from_cuda:
            torch.cuda.synchronize()
        return out

    def _copy(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj)
        if isinstance(obj, dict):
            return type(obj)((k, self._copy(v)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(self._copy(v) for v in obj)
        if isinstance(obj, (int, float, str, bool, bytes, type(None))):
            return obj
        return copy.deepcopy(obj)

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.layout != torch.strided or tensor.is_quantized:
            return tensor.to("cpu", copy=True)  # rare layouts: no buffer reuse
        i = self._index
        self._index += 1
        buf = self._buffers[i] if i < len(self._buffers) else None
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                              pin_memory=tensor.is_cuda)
            if i < len(self._buffers):
                self._buffers[i] = buf
            else:
                self._buffers.append(buf)
        if tensor.is_cuda:
            buf.copy_(tensor, non_blocking=True)
            self._from_cuda = True
        elif tensor.is_contiguous() and tensor.device.type == "cpu":
            # A plain single-threaded memcpy: torch's parallel copy stalls badly when the
            # cores are busy (a descheduled worker thread holds up the whole copy).
            np.copyto(_bytes(buf), _bytes(tensor))
        else:
            buf.copy_(tensor)
        return buf


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    return tensor.reshape(-1).view(torch.uint8).numpy()
