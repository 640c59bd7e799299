"""What the per-step benchmarks share: a gloo process group without torchrun, the reference
trainer's data, and its step (data, forward, backward, clip, optimizer; grad_accum 1).

Not a script: ``step_cost.py``, ``reduction_checksum.py`` and ``telemetry_overhead.py``
import it (run as scripts, their folder is first on ``sys.path``), so that the loop they
time is one loop, written once, and a change to the trainer's step is made here once.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Callable

import torch
import torch.distributed as dist

from trainwatch.rank.telemetry import Telemetry
from trainwatch.trainer.config import Config
from trainwatch.trainer.data import Dataset, ensure_default_dataset, load_dataset
from trainwatch.trainer.train import autocast

_NULL = contextlib.nullcontext()


def no_phase(name: str) -> contextlib.nullcontext:
    """A step's phases when nothing times them: one shared no-op block."""
    return _NULL


def init_gloo() -> tuple[int, int]:
    """Join torchrun's gloo group, or make a one-rank one in this process; (rank, world)."""
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def reference_data(cfg: Config, scratch: str, rank: int) -> Dataset:
    """The trainer's default corpus for ``cfg``, generated under ``scratch`` (per rank)."""
    data_dir = os.path.join(scratch, f"data-{rank}")
    ensure_default_dataset(data_dir, size_bytes=cfg.data.corpus_bytes, seed=cfg.data.corpus_seed,
                           val_fraction=cfg.data.val_fraction)
    return load_dataset(data_dir)


def clip_of(cfg: Config) -> float:
    return cfg.optim.grad_clip or math.inf


def reference_step(ddp: Any, state: Any, clip: float,
                   phase: Callable[[str], Any] = no_phase,
                   device: torch.device | None = None) -> tuple[torch.Tensor, Any, float]:
    """One step of trainer/train.py's loop, each part in ``phase(name)`` (``tel.phase`` to
    time it); the batch moved to ``device`` if given. Returns (loss, grad norm, lr)."""
    with phase("data"):
        x, y = next(state.loader)
        if device is not None:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    with phase("forward"), (_NULL if device is None else autocast(device)):
        _, loss = ddp(x, y)
    with phase("backward"):
        loss.backward()
    with phase("optimizer"):
        grad_norm = torch.nn.utils.clip_grad_norm_(state.model.parameters(), clip)
        lr = state.scheduler.get_last_lr()[0]
        state.optimizer.step()
        state.scheduler.step()
        state.optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm, lr


def telemetry_step(tel: Telemetry, n: int, ddp: Any, state: Any, cfg: Config,
                   device: torch.device | None = None) -> None:
    """The reference step as the trainer times it: in ``tel.step(n)``, its values recorded."""
    with tel.step(n) as record:
        loss, grad_norm, lr = reference_step(ddp, state, clip_of(cfg), tel.phase, device)
        record.record(loss=loss.detach(), grad_norm=grad_norm, lr=lr,
                      tokens=cfg.train.batch_size * cfg.model.context,
                      samples=cfg.train.batch_size)
