"""Moved to ``trainwatch.rank.checkpoint`` (trainwatch/rank/checkpoint/), the in-rank
library; this alias keeps the documented ``from trainwatch.trainer.checkpoint import
CheckpointConfig, Checkpointer`` (and the rest of its exports) working for users, still
lazily: importing it does not import torch. trainwatch's own code imports the new path."""

from typing import Any

from trainwatch.rank import checkpoint as _moved

__all__ = _moved.__all__


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
