"""Crash-safe checkpoints and exact resume for the trainer (docs/checkpoints.md)."""

from trainwatch.trainer.checkpoint.checkpointer import EXIT_STOPPED, Checkpointer
from trainwatch.trainer.checkpoint.config import CheckpointConfig
from trainwatch.trainer.checkpoint.nonfinite import NonFiniteHalt
from trainwatch.trainer.checkpoint.resume import Restored

__all__ = ["Checkpointer", "CheckpointConfig", "EXIT_STOPPED", "NonFiniteHalt", "Restored"]
