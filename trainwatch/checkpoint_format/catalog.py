"""What a checkpoint directory holds: complete checkpoints, newest first, and leftovers.

Listing is cheap (names and manifests only); ``manifest.verify`` does the hashing. A
directory the job saved with torch.distributed.checkpoint (no manifest: ``.metadata`` and
``.distcp`` shards) is listed as kind ``dcp``, state ``dcp``: a checkpoint, but not one the
reference trainer or ``Checkpoints`` can load, so ``complete()`` leaves it out.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from trainwatch.contract.layout import WEIGHTS_CONFIG_DIGEST_KEY
from trainwatch.errors import FormatError
from trainwatch.checkpoint_format import dcp
from trainwatch.checkpoint_format.manifest import (INCOMPLETE_PREFIXES, MANIFEST, read_manifest,
                                                    step_of, weights_config_digest)

DCP_STATE = "dcp"                      # a DCP checkpoint with its .metadata
LISTED_FIRST = ("complete", DCP_STATE)


@dataclass
class Entry:
    """One directory found in a checkpoint folder."""

    path: Path
    step: int | None
    state: str                       # complete | dcp | incomplete | invalid
    manifest: dict[str, Any] | None = None
    reason: str = ""
    kind: str = "trainwatch"         # trainwatch (a manifest) | dcp
    declared: bool = False           # the job declared it (tel.checkpoint_saved)
    shards: int | None = None        # a DCP checkpoint's .distcp files
    disk_bytes: int = 0              # a DCP checkpoint's files, as listed

    @property
    def bytes(self) -> int:
        if not self.manifest:
            return self.disk_bytes
        return sum(entry["bytes"] for entry in self.manifest["files"].values())

    @property
    def val_loss(self) -> float | None:
        value = ((self.manifest or {}).get("metrics") or {}).get("val_loss")
        return float(value) if isinstance(value, (int, float)) else None

    def as_dict(self) -> dict[str, Any]:
        manifest = self.manifest or {}
        return {"path": str(self.path), "name": self.path.name, "step": self.step,
                "state": self.state, "reason": self.reason, "bytes": self.bytes,
                "created_at": manifest.get("created_at"), "val_loss": self.val_loss,
                "world_size": manifest.get("world_size"),
                WEIGHTS_CONFIG_DIGEST_KEY: weights_config_digest(manifest),
                "reason_saved": manifest.get("reason"), "kind": self.kind,
                "declared": self.declared, "shards": self.shards,
                "layout": manifest.get("layout")}


def dcp_entry(path: Path, step: int | None, declared: bool) -> Entry | None:
    """``path`` as a DCP checkpoint (state ``dcp``, or ``invalid`` without its
    ``.metadata``), or None when it is not one."""
    found = dcp.look(path)
    if found is None:
        return None
    return Entry(path, step, DCP_STATE if found.metadata else "invalid",
                 reason=found.describe(declared), kind=dcp.KIND, declared=declared,
                 shards=found.shards, disk_bytes=found.bytes)


def resolved(path: Path) -> Path:
    """How the journal names a declared checkpoint (``tel.checkpoint_saved`` resolves it)."""
    try:
        return path.resolve()
    except OSError:
        return path


def scan(folder: str | Path, declared: Mapping[Path, int] | None = None) -> list[Entry]:
    """Every checkpoint-like directory in ``folder``: complete ones (and DCP ones) newest
    first, then the rest. ``declared``: {resolved path: step} of the checkpoints the job
    declared, which are listed whatever their name (``declared.declared_checkpoints``)."""
    folder = Path(folder)
    declared = declared or {}
    entries: list[Entry] = []
    try:
        children = list(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return entries
    for child in children:
        if not child.is_dir():
            continue
        if child.name.startswith(INCOMPLETE_PREFIXES):
            entries.append(Entry(child, None, "incomplete", reason="save did not finish"))
            continue
        step = step_of(child.name)
        claimed = declared.get(resolved(child)) if declared else None
        if step is None and claimed is None:
            continue  # not ours
        if not os.path.lexists(child / MANIFEST):
            found = dcp_entry(child, claimed if claimed is not None else step,
                              claimed is not None)
            if found is not None:
                entries.append(found)
                continue
        if step is None:
            continue  # declared, but neither ours nor DCP
        try:
            manifest = read_manifest(child)
        except FormatError as exc:
            entries.append(Entry(child, step, "invalid",
                                 reason=f"{MANIFEST}: {str(exc).split(': ', 1)[-1]}"))
            continue
        entries.append(Entry(child, step, "complete", manifest))
    return ordered(entries)


def ordered(entries: list[Entry]) -> list[Entry]:
    """Checkpoints (complete and DCP) newest first, then leftovers and invalid ones."""
    return sorted(entries, key=lambda e: (e.state not in LISTED_FIRST,
                                          -(e.step if e.step is not None else -1), e.path.name))


def complete(folder: str | Path) -> list[Entry]:
    """Checkpoints with a readable manifest, newest first (not yet checksum-verified)."""
    return [e for e in scan(folder) if e.state == "complete"]


def newest_complete(folders: Iterable[str | Path]) -> tuple[int, Path, dict[str, Any]] | None:
    """(step, path, manifest) of the newest complete checkpoint in ``folders``; the earlier
    folder wins a tie. Not yet checksum-verified."""
    found = [(e.step, e.path, e.manifest) for folder in folders for e in complete(folder)
             if e.step is not None and e.manifest is not None]
    return max(found, key=lambda f: f[0], default=None)


def remove_incomplete(folder: str | Path) -> list[Path]:
    """Delete what interrupted saves left behind; returns what was removed."""
    removed = []
    for entry in scan(folder):
        if entry.state == "incomplete":
            shutil.rmtree(entry.path, ignore_errors=True)
            if not entry.path.exists():
                removed.append(entry.path)
    return removed
