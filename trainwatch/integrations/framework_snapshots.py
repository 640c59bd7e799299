"""What the framework callbacks' memory snapshots share (lightning_snapshots.py,
transformers_snapshots.py): a rank's store, the ranks' agreement on the snapshot to resume
from, and the per-process path in the tmpfs that the framework loads it from.

A framework resumes from a path it is given (Lightning's ``ckpt_path``, the Trainer's
``resume_from_checkpoint``), so the agreed snapshot is written there in the framework's own
layout; the path is this process's (``<snapshot root>/<name>/<pid><suffix>``), removed once
loaded, and a killed process's is removed by the next one to stage.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from trainwatch.rank.checkpoint.config import CheckpointConfig
from trainwatch.rank.checkpoint.resume import Restored
from trainwatch.rank.memory_snapshots import peer_resume, store
from trainwatch.rank.memory_snapshots.peer_link import settings_from as peer_settings
from trainwatch.rank.memory_snapshots.snapshotter import MemorySnapshots, for_run, root_of
from trainwatch.rundir.run_dir import RunDir


def snapshot_root(run: RunDir, config: CheckpointConfig) -> Path | None:
    """Where the run's snapshots go (None: off, or no folder for them)."""
    if config.memory_snapshots == "off":
        return None
    return root_of(config.memory_snapshots_dir, run.root)[0]


def open_store(run: RunDir, config: CheckpointConfig, *, rank: int, world_size: int,
               journal: Callable[..., None], why_off: str | None) -> MemorySnapshots:
    """Every rank, at the same point: the rank's store (the Checkpoints API's cadence,
    double buffering and peer copies), off with ``why_off`` (a sharding strategy)."""
    group = None
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        group = (dist.group.WORLD if dist.get_backend() == "gloo"
                 else dist.new_group(backend="gloo"))  # small objects, off the GPU
    memory = for_run(
        config.memory_snapshots, config.memory_snapshots_dir, run.root, rank=rank,
        world_size=world_size, group=group, config_hash=None, journal=journal,
        peers=peer_settings(config.peer_copies, config.peer_copies_offset,
                            config.peer_copies_clique_size, config.peer_copies_nodes))
    if why_off is not None and memory.enabled:
        memory.facts.update(enabled=False, off_reason=why_off)
    return memory


def agree(memory: MemorySnapshots, run: RunDir, durable_step: int | None
          ) -> tuple[Restored | None, dict[str, Any]]:
    """Every rank: the snapshot every rank has, newer than the durable checkpoint (loaded),
    and what ``checkpoint_resumed`` says of it; or None and why none (``memory_snapshot``)."""
    restored, reason = peer_resume.resume(memory, run, durable_step)
    if restored is None:
        memory.peers.after_resume(durable_step)
        return None, {"memory_snapshot": reason}
    memory.facts["resumed_step"] = restored.step
    return restored, peer_resume.resumed_fields(restored, reason, durable_step)


def staged_path(root: Path | None, name: str, suffix: str) -> Path | None:
    """This process's path to stage a snapshot at (nothing there yet), the folder's
    leftovers of dead processes removed; None without a tmpfs to use."""
    if root is None:
        return None
    folder = root / name
    try:
        store.make_folder(folder)
    except OSError:
        return None  # the durable checkpoint, as without snapshots
    for path in folder.iterdir():
        if path.name.endswith(suffix) and not _alive(path.name[:len(path.name) - len(suffix)]):
            remove(path)
    path = folder / f"{os.getpid()}{suffix}"
    remove(path)
    return path


def unstage(path: Path | None) -> None:
    """The framework loaded ``path``: it goes, and its folder once no process has one."""
    if path is None:
        return
    remove(path)
    try:
        path.parent.rmdir()
    except OSError:
        pass  # another local rank's is still there


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _alive(pid: str) -> bool:
    """Whether process ``pid`` exists (a name that is no pid: left alone)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (ValueError, PermissionError):
        return True
    return True
