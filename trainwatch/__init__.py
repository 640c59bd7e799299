"""trainwatch: observability and reliability sidecars for distributed PyTorch training.

``from trainwatch import Telemetry, Checkpoints`` is what a training loop needs; both are
imported on first use, so commands that never touch a job (agent, alerts, report) do not
pay for ``import torch``.
"""

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {"Telemetry": "trainwatch.rank.telemetry",
            "Checkpoints": "trainwatch.rank.checkpoint.checkpoints"}
__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
