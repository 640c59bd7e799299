"""One hash of a model's weights, independent of how they were saved.

Names are sorted, wrapper prefixes (``module.`` from DDP, ``_orig_mod.`` from
torch.compile) are dropped, and each tensor contributes its name, dtype, shape and raw
bytes, so two runs that reached the same weights print the same digest.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Mapping

import torch

WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    return name


def state_digest(state: Mapping[str, Any]) -> str:
    digest = hashlib.sha256()
    tensors = {canonical_name(k): v for k, v in state.items() if isinstance(v, torch.Tensor)}
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def checkpoint_digest(directory: str | Path) -> str:
    """Digest of ``model.pt`` in a checkpoint directory; of a sharded one (DCP layout, no
    ``model.pt``), of its ``model.`` tensors: the same weights give the same digest."""
    from trainwatch.checkpoint_format.dcp import METADATA

    if not (Path(directory) / "model.pt").exists() and (Path(directory) / METADATA).exists():
        import warnings

        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            return dcp_digest(directory, prefix="model.")
    state = torch.load(Path(directory) / "model.pt", map_location="cpu", weights_only=True)
    return state_digest(state)


def dcp_digest(directory: str | Path, prefix: str = "") -> str:
    """Digest of every tensor of a DCP checkpoint (model and optimizer state alike, by the
    names DCP gave them), loaded whole into host memory: the same for any world size that
    wrote it. Objects DCP stored as bytes (steps, learning rates) are left out. ValueError
    when it cannot be loaded. ``prefix``: only the tensors named so, named without it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from trainwatch.rank.checkpoint.dcp_verify import read_metadata

    metadata = read_metadata(Path(directory))
    state = {fqn: torch.empty(tuple(md.size), dtype=md.properties.dtype)
             for fqn, md in metadata.state_dict_metadata.items()
             if isinstance(md, TensorStorageMetadata) and fqn.startswith(prefix)}
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(directory)), no_dist=True)
    except CheckpointException as exc:  # a BaseException: DCP's wrapper of every failure
        raise ValueError(str(exc)) from None
    return state_digest({k[len(prefix):]: v for k, v in state.items()})
