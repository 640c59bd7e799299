"""A framework callback's telemetry settings, checked when the callback is made: a
misspelt one (``TrainwatchCallback(every_step=100)``) used to fail only inside ``fit``, as
``TypeError: Telemetry.__init__() got an unexpected keyword argument``, which named neither
the callback nor what it takes."""

from __future__ import annotations

import inspect
from typing import Any

from trainwatch.errors import ConfigError
from trainwatch.rank.checkpoint.config import CheckpointConfig
from trainwatch.rank.telemetry import Telemetry

# Set by the callback from the framework (the rank, its device), not by the script.
_FROM_FRAMEWORK = {"self", "run_dir", "rank", "local_rank", "world_size", "device"}


def telemetry_options(options: dict[str, Any], owner: str, own: tuple[str, ...]) -> dict[str, Any]:
    """``options`` when every key is a Telemetry setting; else ConfigError naming
    ``owner.key`` and every key the callback takes (``own`` are its own)."""
    known = [name for name in inspect.signature(Telemetry.__init__).parameters
             if name not in _FROM_FRAMEWORK]
    for key in options:
        if key not in known:
            raise ConfigError(f"unknown setting (known: {', '.join(sorted([*own, *known]))})",
                              key=f"{owner}.{key}")
    return options


SNAPSHOT_OPTIONS = ("memory_snapshots", "memory_snapshots_dir", "peer_copies")


def snapshot_options(options: dict[str, Any], owner: str) -> CheckpointConfig:
    """A callback's memory-snapshot settings, with the meaning, defaults and checks of the
    ``checkpoint`` section's (docs/memory-snapshots.md): ConfigError names ``owner.key``."""
    return CheckpointConfig.from_mapping(options, prefix=owner)
