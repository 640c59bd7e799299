"""What a checkpoint directory holds: complete checkpoints, newest first, and leftovers.

Listing is cheap (names and manifests only); ``manifest.verify`` does the hashing.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from trainwatch.contract.layout import WEIGHTS_CONFIG_DIGEST_KEY
from trainwatch.errors import FormatError
from trainwatch.checkpoint_format.manifest import (INCOMPLETE_PREFIXES, MANIFEST, read_manifest,
                                                    step_of, weights_config_digest)


@dataclass
class Entry:
    """One directory found in a checkpoint folder."""

    path: Path
    step: int | None
    state: str                       # complete | incomplete | invalid
    manifest: dict[str, Any] | None = None
    reason: str = ""

    @property
    def bytes(self) -> int:
        if not self.manifest:
            return 0
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
                "reason_saved": manifest.get("reason")}


def scan(folder: str | Path) -> list[Entry]:
    """Every checkpoint-like directory in ``folder``: complete ones newest first, then the rest."""
    folder = Path(folder)
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
        if step is None:
            continue  # not ours
        try:
            manifest = read_manifest(child)
        except FormatError as exc:
            entries.append(Entry(child, step, "invalid",
                                 reason=f"{MANIFEST}: {str(exc).split(': ', 1)[-1]}"))
            continue
        entries.append(Entry(child, step, "complete", manifest))
    entries.sort(key=lambda e: (e.state != "complete", -(e.step if e.step is not None else -1),
                                e.path.name))
    return entries


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
