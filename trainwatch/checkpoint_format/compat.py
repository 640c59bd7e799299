"""Can this run continue a checkpoint exactly? Torch-free, so launchers can ask first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainwatch.contract.layout import WEIGHTS_CONFIG_DIGEST_KEY
from trainwatch.errors import ConfigError
from trainwatch.checkpoint_format.manifest import LAYOUT_DCP, weights_config_digest


# Config sections that do not decide the weights (Config.training_digest leaves them out).
NOT_TRAINING = ("checkpoint", "telemetry", "parallel")


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(before: Any, after: dict[str, Any]) -> str:
    """What differs between the config a run recorded and this launch's, e.g.
    ``train.steps 300 -> 1000``: what a person can act on, unlike two hashes."""
    if not isinstance(before, dict):
        return ""
    old = _flat({k: v for k, v in before.items() if k not in NOT_TRAINING})
    new = _flat({k: v for k, v in after.items() if k not in NOT_TRAINING})
    changed = [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
               if old.get(k) != new.get(k)]
    return "; ".join(changed)


def check_compatible(manifest: dict[str, Any], path: Path, *, config_hash: str | None,
                     changes: str = "", sharded: bool | None = None) -> None:
    """Refuse a checkpoint this run cannot continue exactly (ConfigError, exit code 2);
    ``changes`` (``config_changes``) says what differs from the run's recorded config.
    Any checkpoint resumes at any world size: DCP reshards a sharded one on load, and a
    data-parallel one's replicas need no resharding (per-rank state: resume.py; the
    reference trainer also checks that its global batch splits: trainer/step_shape.py).
    ``sharded``: whether this run's model is sharded (the reference trainer's
    ``parallel.mode: fsdp``), when the run knows; a checkpoint of the other kind is refused
    (None: either kind, as for a user's loop, which finds out when it loads)."""
    is_dcp = manifest.get("layout") == LAYOUT_DCP
    if sharded is not None and sharded != is_dcp:
        if is_dcp:
            what = ("written by a sharded run (DCP shards: parallel.mode fsdp or hsdp), this "
                    "run is data-parallel (parallel.mode: ddp)")
            fix = "set parallel.mode: fsdp (or hsdp; --set parallel.mode=fsdp)"
        else:
            what = ("written by a data-parallel run (parallel.mode: ddp; a whole model.pt), "
                    "this run is sharded (parallel.mode: fsdp or hsdp)")
            fix = "set parallel.mode: ddp (--set parallel.mode=ddp)"
        raise ConfigError(f"{what}; refusing to resume: {fix}, or start a new run directory",
                          file=str(path))
    written = weights_config_digest(manifest)
    if config_hash is not None and written != config_hash:
        raise ConfigError(
            f"written by a config with {WEIGHTS_CONFIG_DIGEST_KEY} {written}, this run's is "
            f"{config_hash}" + (f" (changed: {changes})" if changes else "")
            + "; refusing to resume a different experiment: restore the original config, or "
            "start a new run directory", file=str(path))
