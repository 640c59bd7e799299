"""Can this run continue a checkpoint exactly? Torch-free, so launchers can ask first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainwatch.errors import ConfigError


def check_compatible(manifest: dict[str, Any], path: Path, *, config_hash: str | None,
                     world_size: int) -> None:
    """Refuse a checkpoint this run cannot continue exactly (ConfigError, exit code 2)."""
    if manifest.get("world_size") != world_size:
        raise ConfigError(
            f"written by a run with world size {manifest.get('world_size')}, this run has "
            f"{world_size}; refusing to resume (resharding is not supported): run with the "
            "original world size, or start a new run directory", file=str(path))
    if config_hash is not None and manifest.get("config_hash") != config_hash:
        raise ConfigError(
            f"written by config {manifest.get('config_hash')}, this run's config is "
            f"{config_hash}; refusing to resume a different experiment: restore the original "
            "config, or start a new run directory", file=str(path))
