"""Everything a rank needs to continue training exactly where it stopped, in one object.

``TrainingState.state_dict()`` captures model, optimizer, LR scheduler, the random
number generators (python, numpy, torch, CUDA), the data loader's position and the
step; ``load_state_dict()`` puts all of it back. Checkpointing saves and restores
this one dictionary, so a resumed run continues bit for bit.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainwatch.trainer.data import ShardedBatches
from trainwatch.trainer.step_shape import StepShape


@dataclass
class TrainingState:
    model: torch.nn.Module  # the bare model, not the DDP wrapper
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: ShardedBatches
    step: int = 0  # steps completed, i.e. the next step to run
    mode: str = "ddp"  # parallel.mode: "fsdp" holds DTensor shards (trainer/parallel.py)
    # per-rank batch x accumulation x ranks of a step: the config's, or, resumed at another
    # world size, the one that keeps the checkpoint's global batch (step_shape.py)
    shape: StepShape | None = None

    @property
    def grad_accum(self) -> int:
        return self.shape.grad_accum if self.shape is not None else 1

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step,
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "data": self.loader.state_dict(),
                "rng": capture_rng()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["data"])
        restore_rng(state["rng"])
        self.step = int(state["step"])


def capture_rng() -> dict[str, Any]:
    return {"python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def restore_rng(rng: dict[str, Any]) -> None:
    """Tolerates tuples turned into lists by a serializer."""
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(tuple(rng["numpy"]))
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
