"""When the interval makes a checkpoint due: the one rule the ``Checkpointer`` and the
framework callbacks (``integrations/lightning.py``) share, so a loop and a framework run
with the same ``every_steps`` save at the same steps."""

from __future__ import annotations


def interval_due(step: int, every_steps: int) -> bool:
    """Whether ``step`` (the steps completed) ends an interval of ``every_steps``; 0 means
    no interval (saves then come only on request, on SIGTERM and at the end)."""
    return bool(every_steps) and step % every_steps == 0
