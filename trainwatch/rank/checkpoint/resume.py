"""Choose the checkpoint to resume from and load it.

The newest checkpoint whose every file verifies wins; each newer one that does not is
passed over with the reason (the caller journals ``checkpoint_fallback``).  The mirror
copy of a step is tried before an older step.  A checkpoint written by another config or
world size is refused, never loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainwatch.rank.checkpoint import rng
from trainwatch.checkpoint_format.catalog import scan
from trainwatch.checkpoint_format.compat import check_compatible  # noqa: F401 - resume's API
from trainwatch.checkpoint_format.manifest import Verification, rank_file_name, verify


@dataclass
class Fallback:
    path: Path
    reason: str


def select(folders: list[Path]) -> tuple[Verification | None, list[Fallback]]:
    """The newest verified checkpoint in ``folders`` (primary first), and those passed over."""
    candidates = []
    for order, folder in enumerate(folders):
        candidates += [(e.step, -order, e) for e in scan(folder) if e.step is not None]
    candidates.sort(key=lambda c: (c[0], c[1]), reverse=True)
    passed_over: list[Fallback] = []
    for _, _, entry in candidates:
        if entry.state != "complete":  # invalid, or a DCP checkpoint: not ours to load
            passed_over.append(Fallback(entry.path, entry.reason))
            continue
        result = verify(entry.path)
        if result.ok:
            return result, passed_over
        passed_over.append(Fallback(entry.path, result.reason))
    return None, passed_over


@dataclass
class Restored:
    """A loaded checkpoint: shared state trees and this rank's own state."""

    path: Path
    step: int
    manifest: dict[str, Any]
    shared: dict[str, Any]
    rank_state: dict[str, Any]

    @property
    def data(self) -> Any:
        """This rank's data position, as its loader's ``state_dict`` returned it."""
        return self.rank_state.get("data")

    def restore_rng(self) -> None:
        """Put this rank's RNGs back where they were; call last, after building everything."""
        rng.restore(self.rank_state["rng"])


def load(path: Path, manifest: dict[str, Any], rank: int) -> Restored:
    shared = {name: torch.load(path / f"{name}.pt", map_location="cpu", weights_only=True)
              for name in manifest["shared"]}
    rank_state = torch.load(path / rank_file_name(rank), map_location="cpu", weights_only=True)
    return Restored(path, manifest["step"], manifest, shared, rank_state)
