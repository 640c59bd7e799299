"""Requests to a rank as files: ``control/<name>`` touched calls its handler from the
heartbeat thread.

Requests are files so that anything (an operator, diagnose, the controller) can ask every
rank at once, even while the loop is stuck in a collective; the heartbeat thread polls
them once a beat (a stat per handler).
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any, Callable


class ControlPoller:
    """The handlers of one rank's ``control/`` files and the newest request each answered."""

    def __init__(self, control_dir: Path, guard: Callable[[Callable[[], Any]], Any]):
        self.control_dir = control_dir
        self.guard = guard  # a handler's failure is counted, never raised
        self.handlers: dict[str, Callable[[Path], None]] = {}
        self.paths: dict[str, Path] = {}
        self.seen: dict[str, float] = {}

    def on(self, name: str, handler: Callable[[Path], None]) -> None:
        """Call ``handler(path)`` when ``control/<name>`` is touched after now."""
        self.handlers[name] = handler
        path = self.paths[name] = self.control_dir / name
        with contextlib.suppress(OSError):
            self.seen[name] = path.stat().st_mtime  # ignore stale requests

    def poll(self) -> None:
        for name, handler in list(self.handlers.items()):
            path = self.paths[name]
            try:
                mtime = path.stat().st_mtime
            except FileNotFoundError:
                continue
            if mtime > self.seen.get(name, 0.0):
                self.seen[name] = mtime
                self.guard(functools.partial(handler, path))
