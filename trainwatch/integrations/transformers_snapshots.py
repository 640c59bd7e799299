"""Memory snapshots for the Hugging Face Trainer callback: what a ``checkpoint-N`` folder
holds, every step (or every K), and a resume from the newest state every rank has.

A snapshot is what the Trainer's ``_save_checkpoint`` writes: the model's weights (the
unwrapped model's ``state_dict``), the optimizer's, LR scheduler's and grad scaler's
states, the ``TrainerState`` (its JSON: the step, the epoch, the log history), plus this
rank's RNGs, in the memory-snapshot store of docs/memory-snapshots.md (the same cadence,
double buffering, peer copies and agreement as the Checkpoints API).

``resume_path`` runs after ``Trainer(...)``: ``TrainingArguments`` joined the ranks (the
process group) and the callback's ``on_init_end`` saw the arguments, so the ranks agree
there and then, with or without a durable checkpoint. The agreed snapshot is written as a
checkpoint folder in the Trainer's layout, this process's own in the tmpfs, which
``train(resume_from_checkpoint=)`` loads as it loads ``checkpoint-N``: the weights before
the loop, optimizer and scheduler at its start, the rank's RNG file after it skipped the
batches already trained. The folder goes after the first step.

Supported: single device, DataParallel and DDP (each rank's replica is whole). FSDP,
DeepSpeed and tensor or context parallelism take none (the state there is a shard, or is
gathered with collectives), journaled as ``memory_snapshots_off`` with the reason.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from transformers.trainer import (OPTIMIZER_NAME, SCALER_NAME, SCHEDULER_NAME,
                                  TRAINER_STATE_NAME)
from transformers.training_args import ParallelMode
from transformers.utils import WEIGHTS_NAME

from trainwatch.integrations import framework_snapshots as shared
from trainwatch.rank.checkpoint.config import CheckpointConfig
from trainwatch.rank.checkpoint.resume import Restored
from trainwatch.rank.memory_snapshots.snapshotter import MemorySnapshots
from trainwatch.rundir.run_dir import RunDir

log = logging.getLogger(__name__)
STAGED_DIR = "transformers-staged"  # <snapshot root>/transformers-staged/<pid>-checkpoint/
STAGED_SUFFIX = "-checkpoint"
STATE_KEY = "transformers"
FILES = {"model": WEIGHTS_NAME, "optimizer": OPTIMIZER_NAME, "scheduler": SCHEDULER_NAME,
         "scaler": SCALER_NAME}
NOT_JOINED = ("resume_path() was called before Trainer(...): the ranks had not joined to "
              "agree on a snapshot, so the durable checkpoint is used; call it after")


class TrainerSnapshots:
    """One process's snapshots: ``joined`` (on_init_end), ``resume`` (resume_path),
    ``attach`` (on_train_begin), ``after_step`` (on_step_end) and ``close``."""

    def __init__(self, run: RunDir, config: CheckpointConfig):
        self.run, self.config = run, config
        self.root = shared.snapshot_root(run, config)
        self.args: Any = None               # the Trainer's arguments, once it was built
        self.memory: MemorySnapshots | None = None
        self.staged: Path | None = None     # the folder resume_path() returned
        self.restored: Restored | None = None
        self.journaled: dict[str, Any] | None = None
        self._journal: Callable[..., None] | None = None
        self._pending: list[tuple[str, dict[str, Any]]] = []  # said before telemetry started

    def joined(self, args: Any) -> None:
        self.args = args

    def journal(self, event: str, **fields: Any) -> None:
        fields = {k: v for k, v in fields.items() if v is not None}
        if self._journal is None:
            self._pending.append((event, fields))
        else:
            self._journal(event, **fields)

    def start(self) -> MemorySnapshots:
        """Every rank, once: the store, off with the reason for a strategy that shards."""
        if self.memory is None:
            args = self.args
            self.memory = shared.open_store(self.run, self.config, rank=args.process_index,
                                            world_size=args.world_size, journal=self.journal,
                                            why_off=sharding(args))
        return self.memory

    # ------------------------------------------------------------------ resume_path
    def resume(self, durable_step: int | None) -> Path | None:
        """Every rank: a folder holding the snapshot every rank has, newer than the durable
        checkpoint at ``durable_step``, in the Trainer's layout; None: use the durable one."""
        if self.root is None:
            return None
        if self.args is None:
            self.journaled = {"memory_snapshot": NOT_JOINED}
            log.warning("trainwatch: %s", NOT_JOINED)
            return None
        if self.staged is not None:  # asked again: the same answer
            return self.staged
        restored, self.journaled = shared.agree(self.start(), self.run, durable_step)
        if restored is None:
            return None
        staged = shared.staged_path(self.root, STAGED_DIR, STAGED_SUFFIX)
        if staged is None:
            self.journaled = {"memory_snapshot": f"no folder to stage step {restored.step} in"}
            return None
        _write_checkpoint(staged, restored, self.args)
        self.staged, self.restored = staged, restored
        return staged

    def attach(self, journal: Callable[..., None]) -> MemorySnapshots:
        """on_train_begin, every rank: journal through telemetry, from now on and what was
        said before; the store (opened here when resume_path was not called)."""
        self._journal = journal
        memory = self.start()
        for event, fields in self._pending:
            journal(event, **fields)
        self._pending.clear()
        return memory

    # ------------------------------------------------------------------ in the loop
    def after_step(self, state: Any, model: Any, optimizer: Any, lr_scheduler: Any) -> None:
        """At an optimizer step's end, every rank: a snapshot if due. The staged folder
        goes: the Trainer loaded its last part (the RNGs) before this step."""
        if self.staged is not None:
            shared.unstage(self.staged)
            self.staged = None
        if self.memory is not None and model is not None:
            self.memory.after_step(state.global_step, lambda: {
                STATE_KEY: _state(state, model, optimizer, lr_scheduler)})

    def close(self, finished: bool) -> None:
        """After the last step the snapshots go; otherwise they stay for a restart."""
        shared.unstage(self.staged)
        self.staged = None
        if self.memory is None:
            return
        if finished:
            self.memory.run_finished()
        self.memory.close()


def sharding(args: Any) -> str | None:
    """Why this Trainer's state is not a whole replica per rank, or None."""
    pc = getattr(args, "parallelism_config", None)
    split = [n for n in ("dp_shard_size", "tp_size", "cp_size", "sp_size")
             if (getattr(pc, n, 1) or 1) > 1] if pc is not None else []
    kind = ("FSDP" if getattr(args, "fsdp", None) else
            "DeepSpeed" if getattr(args, "deepspeed", None) else
            f"parallelism_config ({', '.join(split)})" if split else None)
    if kind is None:
        return None
    return (f"{kind} shards or gathers the state: Hugging Face memory snapshots support "
            "single device, DataParallel and DDP; the durable checkpoints still work")


def _state(state: Any, model: Any, optimizer: Any, lr_scheduler: Any) -> dict[str, Any]:
    """What the Trainer's ``checkpoint-N`` holds, less this rank's RNGs (the store's)."""
    tree: dict[str, Any] = {"model": model.state_dict(), "trainer_state": json.dumps(
        dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"}
    if optimizer is not None:
        tree["optimizer"] = optimizer.state_dict()
        scaler = getattr(optimizer, "scaler", None)  # accelerate's wrapper holds fp16's
        if scaler is not None:
            tree["scaler"] = scaler.state_dict()
    if lr_scheduler is not None:
        tree["scheduler"] = lr_scheduler.state_dict()
    return tree


def _write_checkpoint(folder: Path, restored: Restored, args: Any) -> None:
    """``restored`` as a ``checkpoint-N`` folder the Trainer loads (its file names)."""
    folder.mkdir()
    tree = restored.shared[STATE_KEY]
    for key, name in FILES.items():
        if key in tree:
            torch.save(tree[key], folder / name)
    (folder / TRAINER_STATE_NAME).write_text(tree["trainer_state"])
    name = f"rng_state_{args.process_index}.pth" if args.world_size > 1 else "rng_state.pth"
    distributed = args.parallel_mode == ParallelMode.DISTRIBUTED
    torch.save(_trainer_rng(restored.rank_state["rng"], distributed), folder / name)


def _trainer_rng(saved: dict[str, Any], distributed: bool) -> dict[str, Any]:
    """The store's RNG states (rng.capture: lists) in ``_load_rng_state``'s form."""
    version, internal, gauss = saved["python"]
    kind, keys, pos, has_gauss, cached = saved["numpy"]
    out: dict[str, Any] = {"python": (version, tuple(internal), gauss),
                           "numpy": (kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss,
                                     cached),
                           "cpu": saved["torch"]}
    cuda = saved.get("cuda")
    if cuda is not None:  # the Trainer sets every device's when distributed, else one
        out["cuda"] = cuda if distributed else cuda[torch.cuda.current_device()]
    return out
