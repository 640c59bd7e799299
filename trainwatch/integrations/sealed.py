"""Framework checkpoints made verifiable: a trainwatch manifest over the files a framework
wrote, and the newest checkpoint whose every file still matches it.

A framework's own save (``trainer.save_checkpoint``, the Hugging Face Trainer's
``checkpoint-N`` folder) knows nothing of torn writes or bit rot. Sealing one writes
``manifest.json`` (the checkpoint format of docs/checkpoints.md: digest and size per file)
last, so a folder without it is an interrupted save, and resume takes the newest that
verifies, falling back past damaged ones, as for trainwatch's own checkpoints.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from trainwatch import __version__
from trainwatch.contract.layout import WEIGHTS_CONFIG_DIGEST_KEY
from trainwatch.rundir.atomic import atomic_write_json
from trainwatch.checkpoint_format.manifest import (DIGEST, FORMAT, FORMAT_VERSION, MANIFEST,
                                                    digest_file, verify)

log = logging.getLogger(__name__)


def seal(directory: Path, step: int, *, world_size: int, framework: str) -> Path:
    """Write ``manifest.json`` over every file in ``directory`` (a flat folder)."""
    files = {}
    for path in sorted(directory.iterdir()):
        if path.name == MANIFEST:
            continue
        if not path.is_file():
            raise ValueError(f"{path}: a folder inside a checkpoint cannot be sealed")
        files[path.name] = {DIGEST: digest_file(path), "bytes": path.stat().st_size}
    atomic_write_json(directory / MANIFEST, {
        "format": FORMAT, "version": FORMAT_VERSION, "step": step, "created_at": time.time(),
        "reason": "framework", "framework": framework, "world_size": world_size,
        WEIGHTS_CONFIG_DIGEST_KEY: None, "shared": [], "metrics": {}, "files": files,
        "versions": {"trainwatch": __version__}})
    return directory / MANIFEST


def newest_verified(candidates: list[tuple[int, Path]]) -> tuple[int, Path] | None:
    """The (step, folder) with the highest step whose manifest verifies; the others are
    logged with the reason they were passed over."""
    for step, folder in sorted(candidates, key=lambda c: c[0], reverse=True):
        result = verify(folder)
        if result.ok:
            return step, folder
        log.warning("trainwatch: checkpoint %s not used: %s", folder, result.reason)
    return None
