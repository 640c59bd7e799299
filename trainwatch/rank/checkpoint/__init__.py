"""Crash-safe checkpoints and exact resume for any loop (docs/checkpoints.md).

The names below are imported on first use: readers of the checkpoint catalog (the
alert controller deciding a rollback, diagnose, the CLI) must not pay for ``import
torch``, which takes seconds on a loaded node — seconds a rollback would wait.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {"Checkpointer": "checkpointer", "Checkpoints": "checkpoints", "EXIT_STOPPED": "checkpointer",
            "CheckpointConfig": "config", "NonFiniteHalt": "nonfinite", "Restored": "resume"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
