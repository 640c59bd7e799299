"""Memory snapshots for the Lightning callback: the state ``trainer.save_checkpoint`` holds,
every step (or every K), and a resume from the newest state every rank has.

A snapshot is what Lightning checkpoints (``dump_checkpoint``: the module's weights, the
optimizers, LR schedulers, precision plugin, loops' progress, callbacks' states) plus this
rank's RNGs, in the memory-snapshot store of docs/memory-snapshots.md (snapshotter.py: the
same cadence, double buffering, peer copies and agreement as the Checkpoints API). The
module's hyper-parameters are left out (arbitrary objects, which a snapshot's
``weights_only`` load refuses) and put back from the live module at a resume.

``trainer.fit(ckpt_path=)`` is chosen before ``fit``, when the ranks cannot yet agree on
anything; so ``stage`` hands out a path of this process's own in the tmpfs, and ``resume``
(in the callback's ``setup``, after Lightning joined the ranks, before it loads the path)
fills it: the snapshot the ranks agreed on, written as a Lightning checkpoint, or a link to
the durable checkpoint when no snapshot is newer. Only once a durable checkpoint exists:
before it a restart starts over, as without snapshots (there is nothing to link to when the
ranks find no common snapshot).

Supported strategies: single device and DDP (each rank's replica is whole). Sharded ones
(FSDP, ModelParallel, DeepSpeed) take none: ``dump_checkpoint`` there gathers or
consolidates state with collectives, which is not this rank's shard (journaled as
``memory_snapshots_off`` with the reason).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch

from trainwatch.integrations import framework_snapshots as shared
from trainwatch.rank.checkpoint.config import CheckpointConfig
from trainwatch.rank.checkpoint.resume import Restored
from trainwatch.rank.memory_snapshots.snapshotter import MemorySnapshots
from trainwatch.rundir.run_dir import RunDir

SUPPORTED = ("SingleDeviceStrategy", "DDPStrategy")  # exact types: DeepSpeed subclasses DDP
STAGED_DIR = "lightning-staged"  # <snapshot root>/lightning-staged/<pid>.ckpt
STATE_KEY = "lightning"
HPARAMS_KEYS = ("hyper_parameters", "hparams_name", "hparams_type",
                "datamodule_hyper_parameters", "datamodule_hparams_name",
                "datamodule_hparams_type")


class LightningSnapshots:
    """One process's snapshots: ``stage`` (before fit), ``start`` and ``resume`` (setup),
    ``after_step`` (each optimizer step's end), ``restore_rng`` and ``close``."""

    def __init__(self, run: RunDir, config: CheckpointConfig):
        self.run, self.config = run, config
        self.root = shared.snapshot_root(run, config)
        self.staged: Path | None = None       # what resume_path() returned, filled by resume
        self.durable: tuple[int, Path] | None = None
        self.memory: MemorySnapshots | None = None
        self.restored: Restored | None = None  # a resume from memory: its RNGs go back
        self.journaled: dict[str, Any] | None = None

    # ------------------------------------------------------------------ before fit
    def stage(self, durable: tuple[int, Path] | None) -> Path | None:
        """This process's path for ``ckpt_path`` when a snapshot may be newer than the
        durable checkpoint ``durable`` (step, the file or folder fit loads); else None."""
        if durable is None:
            return None
        self.staged = shared.staged_path(self.root, STAGED_DIR, ".ckpt")
        self.durable = durable if self.staged is not None else None
        return self.staged

    # ------------------------------------------------------------------ setup
    def start(self, trainer: Any, journal: Callable[..., None]) -> MemorySnapshots:
        """Every rank, in the callback's setup: the store, off with the reason for a
        strategy that shards."""
        strategy = type(trainer.strategy).__name__
        why = None if strategy in SUPPORTED else (
            f"{strategy} shards or consolidates the state: Lightning memory snapshots "
            f"support {' and '.join(SUPPORTED)}; the durable checkpoints still work")
        self.memory = shared.open_store(self.run, self.config, rank=trainer.global_rank,
                                        world_size=trainer.world_size, journal=journal,
                                        why_off=why)
        return self.memory

    def resume(self, pl_module: Any) -> None:
        """Every rank (after ``start``), when ``stage`` handed out a path: fill it with the
        snapshot every rank has, newer than the durable checkpoint, or link it to that."""
        if self.staged is None or self.durable is None or self.memory is None:
            return
        step, target = self.durable
        restored, self.journaled = shared.agree(self.memory, self.run, step)
        if restored is None:
            os.symlink(target, self.staged)
            return
        state = dict(restored.shared[STATE_KEY])
        if getattr(pl_module, "hparams", None):
            state[pl_module.CHECKPOINT_HYPER_PARAMS_KEY] = dict(pl_module.hparams)
        torch.save(state, self.staged)
        self.restored = restored

    def loaded(self) -> None:
        """Lightning loaded the staged path: it goes (the snapshot it came from stays)."""
        shared.unstage(self.staged)
        if self.restored is not None:
            self.restored.restore_rng()  # RNGs last, as for the Checkpoints API

    # ------------------------------------------------------------------ in the loop
    def after_step(self, trainer: Any) -> None:
        """At an optimizer step's end, every rank: a snapshot if due."""
        if self.memory is not None:
            self.memory.after_step(trainer.global_step, lambda: {STATE_KEY: _state(trainer)})

    def close(self, finished: bool) -> None:
        """After the last step the snapshots go; otherwise they stay for a restart."""
        if self.memory is None:
            return
        if finished:
            self.memory.run_finished()
        self.memory.close()


def _state(trainer: Any) -> dict[str, Any]:
    """What ``trainer.save_checkpoint`` would write, less the hyper-parameters."""
    state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    for key in HPARAMS_KEYS:
        state.pop(key, None)
    return state

