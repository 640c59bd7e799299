"""Choose the checkpoint to resume from and load it.

The newest checkpoint whose every file verifies wins; each newer one that does not is
passed over with the reason (the caller journals ``checkpoint_fallback``).  The mirror
copy of a step is tried before an older step.  A checkpoint written by another config
is refused, never loaded; one of another world size is resumed (``_rank_state``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import xxhash

from trainwatch.rank.checkpoint import rng
from trainwatch.checkpoint_format.catalog import Entry, scan
from trainwatch.checkpoint_format.compat import check_compatible  # noqa: F401 - resume's API
from trainwatch.checkpoint_format.manifest import LAYOUT_DCP, Verification, rank_file_name
from trainwatch.rank.checkpoint.dcp_verify import verify_checkpoint


@dataclass
class Fallback:
    path: Path
    reason: str


def select(folders: list[Path], check: Callable[[Path], Verification] = verify_checkpoint,
           scanned: dict[Path, list[Entry]] | None = None
           ) -> tuple[Verification | None, list[Fallback]]:
    """The newest verified checkpoint in ``folders`` (primary first), and those passed over;
    ``check``: how a checkpoint is verified (parallel_verify.py spreads it over the ranks);
    ``scanned``: {folder: its ``scan``} already listed (the folder is not listed again)."""
    candidates = []
    for order, folder in enumerate(folders):
        entries = scanned[folder] if scanned and folder in scanned else scan(folder)
        candidates += [(e.step, -order, e) for e in entries if e.step is not None]
    candidates.sort(key=lambda c: (c[0], c[1]), reverse=True)
    passed_over: list[Fallback] = []
    for _, _, entry in candidates:
        if entry.state != "complete":  # invalid, or a DCP checkpoint: not ours to load
            passed_over.append(Fallback(entry.path, entry.reason))
            continue
        result = check(entry.path)  # a sharded one against its .metadata too
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
    resharded: dict[str, Any] | None = None  # journaled: from and to world size, what changed

    @property
    def data(self) -> Any:
        """This rank's data position, as its loader's ``state_dict`` returned it."""
        return self.rank_state.get("data")

    def restore_rng(self) -> None:
        """Put this rank's RNGs back where they were; call last, after building everything."""
        rng.restore(self.rank_state["rng"])


def wanted_files(manifest: dict[str, Any], rank: int, world_size: int) -> list[str]:
    """The files of checkpoint ``manifest`` that ``load`` reads on ``rank``: the shared trees
    of a data-parallel one, and the rank files ``_rank_state`` takes."""
    names = ([] if manifest.get("layout") == LAYOUT_DCP
             else [f"{name}.pt" for name in manifest.get("shared") or ()])
    written = manifest.get("world_size") or 0
    ranks = [rank] if written == world_size else [0] + ([rank] if 0 < rank < written else [])
    return names + [rank_file_name(r) for r in ranks]


def load(path: Path, manifest: dict[str, Any], rank: int, world_size: int = 1,
         preloaded: dict[str, Any] | None = None) -> Restored:
    """This rank's part of checkpoint ``path``: the shared trees of a data-parallel one,
    and its own state (RNGs, data position), at any world size. A sharded (DCP)
    checkpoint's trees are loaded by its caller, into the job's objects (sharded.py).
    ``preloaded``: {file name: value} already loaded while it was verified
    (parallel_verify.py); the rest is read here."""
    files = _Files(path, preloaded or {})
    rank_state, resharded = _rank_state(files, manifest, rank, world_size)
    if manifest.get("layout") == LAYOUT_DCP:
        return Restored(path, manifest["step"], manifest, {}, rank_state, resharded)
    shared = {name: files.load(f"{name}.pt") for name in manifest["shared"]}
    return Restored(path, manifest["step"], manifest, shared, rank_state, resharded)


class _Files:
    """A checkpoint's files by name: the value loaded while verifying, else torch.load."""

    def __init__(self, path: Path, preloaded: dict[str, Any]):
        self.path, self.preloaded = path, preloaded

    def load(self, name: str) -> Any:
        if name in self.preloaded:
            return self.preloaded.pop(name)
        return torch.load(self.path / name, map_location="cpu", weights_only=True)


def _rank_state(files: _Files | Path, manifest: dict[str, Any], rank: int, world_size: int
                ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Its own file at the world size that wrote it. At another world size: rank 0's data
    position for every rank (the job's global progress; docs/checkpoints.md), a rank's own
    RNGs where it existed, and fresh ones, derived from rank 0's and the rank, where not.
    Data-parallel checkpoints and sharded ones alike: replicas need no resharding.
    ``files``: the checkpoint's folder, or its files with those already loaded."""
    files = files if isinstance(files, _Files) else _Files(files, {})
    written = manifest["world_size"]

    def own(r: int) -> dict[str, Any]:
        return files.load(rank_file_name(r))

    if written == world_size:
        return own(rank), None
    first = own(0)
    state: dict[str, Any] = (own(rank) if rank < written
                             else {"rng": derived_rng(first["rng"], rank)})
    state["data"] = first.get("data")
    return state, {"from_world_size": written, "to_world_size": world_size,
                   "data": "rank 0's position, on every rank",
                   "rng_reseeded": list(range(written, world_size)) or None}


def derived_rng(rank0: dict[str, Any], rank: int) -> dict[str, Any]:
    """RNG state for a rank the checkpoint did not have: seeded from a digest of rank 0's
    saved torch RNG state and the rank, so every restart derives the same one."""
    seed = xxhash.xxh3_64_intdigest(rank0["torch"].numpy().tobytes() + rank.to_bytes(4, "little"))
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    fresh = rng.capture()
    fresh["cuda"] = None
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.set_rng_state(saved[2])
    return fresh
