"""Real torch.distributed.checkpoint (DCP) checkpoints for tests: ``dcp.save`` by a 1-process
gloo group in the test's own process (a FileStore: no port), declared in a run directory
by the real ``Telemetry.checkpoint_saved``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainwatch.rank.telemetry import Telemetry


def small_state() -> dict[str, Any]:
    return {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3)},
            "optim": {"step": 5, "lr": 0.1}}


def save_dcp(path: Path, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """``dcp.save`` of ``state`` (default ``small_state()``) into ``path``; returns it."""
    state = small_state() if state is None else state
    store = path.parent / f".{path.name}.store"
    path.parent.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        dcp.save(state, checkpoint_id=str(path))
    finally:
        dist.destroy_process_group()
        store.unlink(missing_ok=True)
    return state


def declare(run_dir: Path, path: Path, step: int) -> None:
    """What a job's ``tel.checkpoint_saved(path, step)`` journals."""
    tel = Telemetry(run_dir, heartbeat_interval=3600, exchange_every=0).start()
    try:
        tel.checkpoint_saved(path, step)
    finally:
        tel.close()


def shard(path: Path) -> Path:
    """The one shard file a 1-process save writes."""
    (found,) = path.glob("*.distcp")
    return found
