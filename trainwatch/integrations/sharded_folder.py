"""A Lightning strategy's sharded checkpoint (a folder, not a file) as a trainwatch step folder.

ModelParallelStrategy (FSDP2) and ``FSDPStrategy(state_dict_type="sharded")`` make the
checkpoint path a folder: torch.distributed.checkpoint's ``.metadata``, one ``.distcp``
shard per rank, and rank 0's ``meta.pt`` (loops, callbacks, the rest). Moved up into
``step-N/`` it is sealed like any checkpoint of plain files, and ``trainer.fit(ckpt_path=)``
takes that folder as it is (Lightning loads a folder holding ``meta.pt`` as sharded).
A folder of folders (DeepSpeed's) cannot be sealed: bad input, with the way out.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainwatch.checkpoint_format.dcp import METADATA as DCP_METADATA
from trainwatch.errors import ConfigError

LIGHTNING_META = "meta.pt"  # lightning.fabric.strategies.fsdp._METADATA_FILENAME


def flatten(saved: Path, strategy: str) -> None:
    """Move the files of the folder ``saved`` up into its parent (the step folder being
    written); nothing when ``saved`` is a file (a full, rank-0 checkpoint)."""
    if not saved.is_dir():
        return
    entries = sorted(saved.iterdir())
    nested = [p.name for p in entries if not p.is_file()]
    if nested or not (saved / LIGHTNING_META).is_file():
        raise ConfigError(
            f"{strategy} saved a checkpoint trainwatch cannot seal ({saved} holds "
            f"{', '.join(nested) or 'no ' + LIGHTNING_META}): TrainwatchCallback seals "
            "Lightning's single-file checkpoints and torch.distributed.checkpoint folders "
            "(ModelParallelStrategy, FSDPStrategy, DDP); use one of those strategies with "
            "TrainwatchCallback, or Lightning's own ModelCheckpoint without it",
            key="strategy")
    for path in entries:
        os.rename(path, saved.parent / path.name)
    saved.rmdir()


def checkpoint_in(folder: Path, name: str) -> Path | None:
    """What ``trainer.fit(ckpt_path=)`` takes from a step folder: the single file ``name``,
    or the folder itself when it holds a sharded save; None when it holds neither."""
    if (folder / name).is_file():
        return folder / name
    if (folder / DCP_METADATA).is_file() and (folder / LIGHTNING_META).is_file():
        return folder
    return None
