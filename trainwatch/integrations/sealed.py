"""Framework checkpoints made verifiable: a trainwatch manifest over the files a framework
wrote, and the newest checkpoint whose every file still matches it.

A framework's own save (``trainer.save_checkpoint``, the Hugging Face Trainer's
``checkpoint-N`` folder) knows nothing of torn writes or bit rot. Sealing one writes
``manifest.json`` (the checkpoint format of docs/checkpoints.md: digest and size per file)
last, so a folder without it is an interrupted save, and resume takes the newest that
verifies, falling back past damaged ones, as for trainwatch's own checkpoints.

A sharded save (torch.distributed.checkpoint: ``.metadata`` and every rank's ``.distcp``
shard, as Lightning's ModelParallelStrategy writes) is sealed with ``layout: dcp`` and the
shard files its metadata names: sealing refuses one that lacks a shard, and ``verify``
checks the manifest still covers them all.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from trainwatch import __version__
from trainwatch.checkpoint_format.dcp import METADATA as DCP_METADATA
from trainwatch.contract.layout import WEIGHTS_CONFIG_DIGEST_KEY
from trainwatch.errors import ConfigError
from trainwatch.rundir.atomic import atomic_write_json
from trainwatch.checkpoint_format.manifest import (DIGEST, FORMAT, FORMAT_VERSION, LAYOUT_DCP,
                                                    MANIFEST, digest_file, verify)

log = logging.getLogger(__name__)


def seal(directory: Path, step: int, *, world_size: int, framework: str,
         folders: str = "", key: str = "callbacks") -> Path:
    """Write ``manifest.json`` over every file in ``directory`` (a flat folder). A folder
    inside is bad input (ConfigError on ``key``; ``folders`` says the way out): the manifest
    lists files, so a sub-folder's contents would go unverified."""
    files = {}
    for path in sorted(directory.iterdir()):
        if path.name == MANIFEST:
            continue
        if not path.is_file():
            raise ConfigError(f"{framework} wrote a folder inside its checkpoint ({path}); "
                              "trainwatch seals a checkpoint of plain files only, so it cannot "
                              f"verify or resume this one. {folders}".rstrip(), key=key)
        files[path.name] = {DIGEST: digest_file(path), "bytes": path.stat().st_size}
    manifest: dict[str, Any] = {
        "format": FORMAT, "version": FORMAT_VERSION, "step": step, "created_at": time.time(),
        "reason": "framework", "framework": framework, "world_size": world_size,
        WEIGHTS_CONFIG_DIGEST_KEY: None, "shared": [], "metrics": {}, "files": files,
        "versions": {"trainwatch": __version__}}
    if DCP_METADATA in files:
        manifest.update(layout=LAYOUT_DCP, dcp={"files": _dcp_shards(directory, files)})
    atomic_write_json(directory / MANIFEST, manifest)
    return directory / MANIFEST


def _dcp_shards(directory: Path, files: dict[str, Any]) -> list[str]:
    """The shard files a DCP save's ``.metadata`` names, each present and long enough:
    else the save lost a rank's shard and sealing it would verify half a model."""
    from trainwatch.rank.checkpoint.dcp_verify import covers, needed_sizes, read_metadata

    problems = covers(directory, {"files": files})
    if problems:
        raise RuntimeError(f"{directory}: the sharded checkpoint is incomplete, not sealed: "
                           + "; ".join(problems[:5]))
    return sorted(needed_sizes(read_metadata(directory)))


def newest_verified(candidates: list[tuple[int, Path]]) -> tuple[int, Path] | None:
    """The (step, folder) with the highest step whose manifest verifies; the others are
    logged with the reason they were passed over."""
    for step, folder in sorted(candidates, key=lambda c: c[0], reverse=True):
        result = verify(folder)
        if result.ok:
            return step, folder
        log.warning("trainwatch: checkpoint %s not used: %s", folder, result.reason)
    return None
