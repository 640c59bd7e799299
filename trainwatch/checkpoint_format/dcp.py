"""A torch.distributed.checkpoint (DCP) directory, recognized by its file names alone.

A job that shards its state (FSDP2) saves with ``dcp.save`` and declares the directory with
``tel.checkpoint_saved``: DCP writes ``__<rank>_<n>.distcp`` shard files, then ``.metadata``
last, from the coordinator, once every rank's files are written. So a directory with shards
and no ``.metadata`` is a save that did not finish. Torch-free, and nothing here opens a
file: ``.metadata`` is a pickle, unpickled only by the torch-side ``trainwatch checkpoint
verify`` (trainwatch/rank/checkpoint/dcp_verify.py). docs/checkpoints.md, "Declared DCP
checkpoints".
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

KIND = "dcp"
METADATA = ".metadata"
SHARD_SUFFIX = ".distcp"


@dataclass
class DcpLook:
    """What the names and sizes in a DCP directory say (no file is opened)."""

    shards: int          # *.distcp files (DCP names them __<rank>_<n>.distcp)
    metadata: bool       # .metadata is there (verify checks what it holds)
    bytes: int           # of the regular files in it

    def describe(self, declared: bool) -> str:
        """``DCP checkpoint, 2 shard files, metadata present, declared by the job``."""
        text = f"DCP checkpoint, {self.shards} shard file{'s' if self.shards != 1 else ''}, "
        if not self.metadata:
            return text + f"{METADATA} missing (the save did not finish, or it was deleted)"
        return text + "metadata present, " + ("declared by the job" if declared
                                              else "not declared in this run's journal")


def look(directory: Path) -> DcpLook | None:
    """The DCP files of ``directory``, or None when it holds neither ``.metadata`` nor a
    shard file (not a DCP checkpoint)."""
    shards, metadata, size = 0, False, 0
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                size += st.st_size if stat.S_ISREG(st.st_mode) else 0
                if entry.name == METADATA:
                    metadata = True
                elif entry.name.endswith(SHARD_SUFFIX):
                    shards += 1
    except OSError:
        return None
    if not metadata and not shards:
        return None
    return DcpLook(shards, metadata, size)
