"""Copy a training-state tree to host memory, quickly, so the loop can move on.

The copy is the only part of an async save the loop waits for.  Host buffers are kept
and reused (at most one save is in flight, so the previous copy is free again), which
spares an allocation of the whole state per save; from a GPU the copies go to pinned
memory without blocking, and one synchronize per tree waits for them; on the CPU they are
plain memcpys, in chunks that another thread may take too.

The trees of one save (model, optimizer, ...) are handed to the writer one by one
(``Handoff``). The writer starts with the save, and as long as the loop has memcpys left
it takes chunks of them before it writes anything: on the CPU two threads copy (289 MB in
21 ms instead of 30 on a 2-core VM) and the loop is not slowed by a writer competing for
the cores; then the writer writes. From a GPU the copies are the device's, there is
nothing to take, and the writer writes the model's file while the optimizer is still
being copied. Either way the loop waits only for the copy, and an async save is not the
copy's whole time slower to durable than a sync one.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import numpy as np
import torch

COPY_CHUNK = 4 << 20  # bytes a thread takes at a time: a descheduled helper delays the loop
#                       by one chunk at most (torch's parallel copy splits the work up front
#                       and waits for its slowest thread, which stalls badly on busy cores)


class Copies:
    """The host memcpys of one tree, chunk by chunk, for the loop and one helper to share."""

    def __init__(self, memcpys: list[tuple[np.ndarray, np.ndarray]]):
        self._chunks = [(dst[i:i + COPY_CHUNK], src[i:i + COPY_CHUNK])
                        for dst, src in memcpys for i in range(0, dst.nbytes, COPY_CHUNK)]
        self._next = 0
        self._busy = 0
        self._error: BaseException | None = None
        self._done = threading.Condition()

    def __bool__(self) -> bool:
        return bool(self._chunks)

    def _take(self, helping: bool) -> tuple[np.ndarray, np.ndarray] | None:
        with self._done:
            if self._next >= len(self._chunks) or self._error is not None:
                return None
            self._next += 1
            self._busy += helping
            return self._chunks[self._next - 1]

    def work(self) -> None:
        """The loop's part: copy chunks until none is left to take."""
        while (chunk := self._take(False)) is not None:
            np.copyto(*chunk)  # numpy lets go of the GIL for the memcpy

    def help(self) -> None:
        """Another thread's part; ``finish`` waits for each chunk it took (only the
        helpers' chunks are counted: a Ctrl-C in the loop's thread cannot upset that)."""
        while (chunk := self._take(True)) is not None:
            try:
                np.copyto(*chunk)
            except BaseException as exc:  # kept for the loop to raise
                with self._done:
                    self._error = self._error or exc
            finally:
                with self._done:
                    self._busy -= 1
                    self._done.notify_all()

    def finish(self) -> None:
        """The loop's last word: hand out no more chunks, wait for the helpers' (the loop
        never moves on while a helper still writes into a buffer), raise a helper's error."""
        with self._done:
            self._next = len(self._chunks)
            self._done.wait_for(lambda: self._busy == 0)
            error = self._error
        if error is not None:
            raise error


class HostSnapshot:
    """Reusable host buffers for the tensors of one state tree."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._index = 0
        self._from_cuda = False
        self._memcpys: list[tuple[np.ndarray, np.ndarray]] = []  # (destination, source) bytes

    def capture(self, tree: Any) -> Any:
        """A copy of ``tree`` whose tensors live in this snapshot's host buffers."""
        self.start()
        out = self.copy(tree)
        self.finish()
        return out

    def start(self) -> None:
        """Begin a snapshot; ``copy`` each tree, then ``finish``."""
        self._index = 0

    def copy(self, tree: Any, offer: Callable[[Copies | None], None] | None = None) -> Any:
        """One tree of the snapshot, complete when this returns (GPU copies synchronized).

        ``offer`` is shown the memcpys, so another thread can take some
        (``Handoff.offer``); they stay offered, all taken, until the next tree's are, so
        a helper does not take this tree to write before the next tree's copy has
        started; a tree with none to share (from a GPU) offers None.
        """
        self._from_cuda = False
        self._memcpys = []
        out = self._copy(tree)
        copies = Copies(self._memcpys)
        self._memcpys = []
        if offer is not None:
            offer(copies if copies else None)
        try:
            copies.work()
        finally:
            copies.finish()
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
        buf = host_buffer(self._buffers, self._index, tensor)
        self._index += 1
        if tensor.is_cuda:
            buf.copy_(tensor, non_blocking=True)
            self._from_cuda = True
        elif tensor.is_contiguous() and tensor.device.type == "cpu":
            self._memcpys.append((_bytes(buf), _bytes(tensor)))  # done in ``copy``, shared
        else:
            buf.copy_(tensor)
        return buf


def host_buffer(buffers: list[torch.Tensor], i: int, tensor: torch.Tensor) -> torch.Tensor:
    """The ``i``-th host buffer kept between copies, made anew when ``tensor``'s shape or
    dtype changed (pinned when it comes from a GPU); the buffers outlive one copy, so a
    copy of the same state allocates nothing."""
    buf = buffers[i] if i < len(buffers) else None
    if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
        buf = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                          pin_memory=tensor.is_cuda)
        if i < len(buffers):
            buffers[i] = buf
        else:
            buffers.append(buf)
    return buf


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    return tensor.reshape(-1).view(torch.uint8).numpy()


class SnapshotFailed(RuntimeError):
    """The loop could not copy the state (e.g. no host memory); the save is abandoned."""


class Handoff(Mapping):
    """The trees of one save, by name, each readable once the loop has copied it.

    Reading a tree (the writer) first helps with the loop's memcpys while there are any
    (``offer``), then waits for the tree if it is not copied yet; ``blocking`` waits for
    the whole copy and says how long the loop was held.
    """

    def __init__(self, names: list[str], started: float):
        self._names = list(names)
        self._started = started
        self._trees: dict[str, Any] = {}
        self._blocking: float | None = None
        self._error: BaseException | None = None
        self._copies: Copies | None = None
        self._ready = threading.Condition()

    def offer(self, copies: Copies | None) -> None:
        """The memcpys of the tree the loop is copying, for the writer to share first."""
        with self._ready:
            self._copies = copies
            self._ready.notify_all()

    def put(self, name: str, tree: Any) -> None:
        with self._ready:
            self._trees[name] = tree
            self._ready.notify_all()

    def close(self) -> None:
        """Everything is copied: the loop moves on now."""
        with self._ready:
            self._blocking = time.perf_counter() - self._started
            self._copies = None
            self._ready.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._ready:
            self._error = exc
            self._copies = None
            self._ready.notify_all()

    def _wait(self, done: Any) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: done() or self._error is not None
                                     or self._copies is not None)
                if self._error is not None:
                    raise SnapshotFailed(f"copying the state to host memory failed: "
                                         f"{self._error}") from self._error
                copies = self._copies
                if copies is None:
                    return
            copies.help()  # copying first: the loop waits for it, nobody waits for the write
            self._wait_past(copies)

    def help(self) -> None:
        """Take part in the loop's memcpys until none are left to take (the writer, first)."""
        self._wait(lambda: True)

    def _wait_past(self, copies: Copies) -> None:
        """Until the loop offers the next tree's memcpys, or is done copying."""
        with self._ready:
            self._ready.wait_for(lambda: self._copies is not copies or self._error is not None)

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
