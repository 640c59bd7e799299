"""Each rank's own small state of every step: its RNGs and data position.

A full snapshot comes every K steps (cadence.py); between two, a rank's state lives only in
its memory. For data-parallel state a survivor's model and optimizer are the dead rank's too
(dying_gasp.py writes them), all but what is the rank's own: its random streams and its
data position. Those are a few KB, so every rank keeps them every step, here, in the store's
format (``<root>/parts/rank-NNNNN/step-<step>.snap``, the newest two), written on the loop
when the step ends (0.3-1 ms on the 2-core CI VM: docs/memory-snapshots.md): a writer
thread lost the race against a SIGKILL landing just after the step's end. Only between full
snapshots (K > 1): with a snapshot every step they add nothing.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from trainwatch.contract.layout import rank_file_name
from trainwatch.rank.checkpoint import rng
from trainwatch.rank.memory_snapshots import store

log = logging.getLogger(__name__)

PARTS_DIR = "parts"
KEEP = 2


def parts_folder(root: Path, rank: int) -> Path:
    return root / PARTS_DIR / rank_file_name(rank, "")


def rank_state(raw: tuple[Any, ...], data: Any) -> dict[str, Any]:
    """What a snapshot's ``rank`` part holds, from ``rng.capture_raw`` and the position."""
    return {"rng": rng.from_raw(raw), "data": data}


class RankParts:
    """One rank's parts, written on the loop: a part must be sealed before the next step can
    fail (a writer thread lost the race to a SIGKILL right after the step's end)."""

    def __init__(self, root: Path, rank: int, world_size: int, config_hash: str | None):
        self.folder = parts_folder(root, rank)
        self.rank, self.world_size, self.config_hash = rank, world_size, config_hash
        self.pinned: int | None = None  # a step whose part stays (dying_gasp.py)
        self.written = -1
        self.failed_total = 0
        self.last_error: str | None = None
        self._made = False

    def note(self, step: int, raw: tuple[Any, ...], data: Any) -> store.Sealed | None:
        """Step ``step``'s RNG states (raw) and data position, sealed (None: not kept);
        never raises."""
        payload = {"step": step, "rank": rank_state(raw, data)}
        try:
            if not self._made:
                store.make_folder(self.folder)
                self._made = True
            sealed = store.seal(self.folder, rank=self.rank, step=step,
                                world_size=self.world_size, config_hash=self.config_hash,
                                write=lambda f: torch.save(payload, f),
                                version=store.TORCH_SAVED)
            self.written = step
            store.retain(self.folder, {step - i for i in range(KEEP)} | {self.pinned or -1})
            return sealed
        except Exception as exc:  # a part not kept costs the gasp, never the job
            self.failed_total += 1
            if self.last_error is None:
                log.warning("trainwatch: rank part of step %s not kept: %s", step, exc)
            self.last_error = f"{type(exc).__name__}: {exc}"
            return None


def listed(root: Path, rank: int) -> list[store.Sealed]:
    """This rank's sealed parts, newest first (headers only)."""
    return store.sealed(parts_folder(root, rank))
