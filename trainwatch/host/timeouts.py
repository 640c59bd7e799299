"""Run a blocking filesystem call with a deadline, without ever piling up hung threads.

A call on a hung mount (NFS, Lustre, a dying disk) can block forever in the kernel and
cannot be cancelled.  ``Deadline`` runs it in a daemon thread, stops waiting after the
timeout, and refuses to start another call for the same key until the hung one returns.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Any, Callable


class Hung(Exception):
    """The call did not finish in time (or an earlier one for this key is still hung)."""


class Deadline:
    def __init__(self) -> None:
        self._inflight: dict[str, tuple[Future, float]] = {}

    def call(self, key: str, fn: Callable[[], Any], timeout: float) -> Any:
        pending = self._inflight.get(key)
        if pending is not None:
            previous, since = pending
            if not previous.done():
                raise Hung(f"previous call still hung after {time.time() - since:.1f} s")
            del self._inflight[key]
        future: Future = Future()

        def target() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # handed to the caller
                    future.set_exception(exc)

        threading.Thread(target=target, daemon=True, name=f"deadline-{key[:40]}").start()
        try:
            return future.result(timeout=timeout)
        except FutureTimeout:
            self._inflight[key] = (future, time.time())
            raise Hung(f"no answer within {timeout:g} s (hung filesystem?)") from None
