"""Copy a training-state tree to host memory, quickly, so the loop can move on.

The copy is the only part of an async save the loop waits for.  Host buffers are kept
and reused (at most one save is in flight, so the previous copy is free again), which
spares an allocation of the whole state per save; from a GPU the copies go to pinned
memory without blocking, and one synchronize per tree waits for them; on the CPU they are
plain memcpys.

The trees of one save (model, optimizer, ...) are handed to the writer one by one
(``Handoff``): it writes the model's file while the loop still copies the optimizer, so
an async save is not the copy's time slower to durable than a sync one.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Mapping
from typing import Any, Iterator

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
        self.start()
        out = self.copy(tree)
        self.finish()
        return out

    def start(self) -> None:
        """Begin a snapshot; ``copy`` each tree, then ``finish``."""
        self._index = 0

    def copy(self, tree: Any) -> Any:
        """One tree of the snapshot, complete when this returns (GPU copies synchronized)."""
        self._from_cuda = False
        out = self._copy(tree)
        if self._from_cuda:
            torch.cuda.synchronize()
        return out

    def finish(self) -> None:
        del self._buffers[self._index:]  # the state shrank: free what is unused

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


class SnapshotFailed(RuntimeError):
    """The loop could not copy the state (e.g. no host memory); the save is abandoned."""


class Handoff(Mapping):
    """The trees of one save, by name, each readable once the loop has copied it.

    Reading a tree not yet copied waits for it; ``blocking`` waits for the whole copy
    and says how long the loop was held.
    """

    def __init__(self, names: list[str], started: float):
        self._names = list(names)
        self._started = started
        self._trees: dict[str, Any] = {}
        self._blocking: float | None = None
        self._error: BaseException | None = None
        self._ready = threading.Condition()

    def put(self, name: str, tree: Any) -> None:
        with self._ready:
            self._trees[name] = tree
            self._ready.notify_all()

    def close(self) -> None:
        """Everything is copied: the loop moves on now."""
        with self._ready:
            self._blocking = time.perf_counter() - self._started
            self._ready.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._ready:
            self._error = exc
            self._ready.notify_all()

    def _wait(self, done: Any) -> None:
        with self._ready:
            self._ready.wait_for(lambda: done() or self._error is not None)
            if self._error is not None:
                raise SnapshotFailed(f"copying the state to host memory failed: "
                                     f"{self._error}") from self._error

    def __getitem__(self, name: str) -> Any:
        if name not in self._names:
            raise KeyError(name)
        self._wait(lambda: name in self._trees)
        return self._trees[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def blocking(self) -> float:
        self._wait(lambda: self._blocking is not None)
        assert self._blocking is not None
        return self._blocking
