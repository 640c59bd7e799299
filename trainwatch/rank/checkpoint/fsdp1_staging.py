"""Host copies of FSDP1's ShardedTensors for an async sharded save.

DCP's stagers (``DefaultStager``, ``BlockingAsyncStager``) copy plain tensors and DTensors
but fail on a ShardedTensor, which FSDP1's sharded state dict is made of ("torch function
'data_ptr' ... not supported for ShardedTensor!"): every async save of an FSDP1 model
failed. Here each ShardedTensor is taken out of the trees before the stager runs and put
back as a ShardedTensor over host copies of this rank's local shards, with the same global
metadata (its placements moved to the CPU), built without a collective. The rest is left to
DCP's stager, as before.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from trainwatch.rank.checkpoint.whole_state import is_dtensor, is_sharded_tensor

_SLOT = "\0trainwatch-sharded-tensor-"  # a string: DCP's stager keeps it as it is


def stage(stager: Any, trees: dict[str, Any]) -> dict[str, Any]:
    """``stager.stage(trees)``, each ShardedTensor copied to host memory here."""
    held: list[Any] = []
    staged = stager.stage(_take_out(trees, held))
    return _put_back(staged, held) if held else staged


def _take_out(tree: Any, held: list[Any]) -> Any:
    if isinstance(tree, torch.Tensor) and is_sharded_tensor(tree) and not is_dtensor(tree):
        held.append(tree)
        return f"{_SLOT}{len(held) - 1}"
    if isinstance(tree, dict):
        return {k: _take_out(v, held) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_take_out(v, held) for v in tree]
    return tree


def _put_back(tree: Any, held: list[Any]) -> Any:
    if isinstance(tree, str) and tree.startswith(_SLOT):
        return _host_copy(held[int(tree[len(_SLOT):])])
    if isinstance(tree, dict):
        return {k: _put_back(v, held) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_put_back(v, held) for v in tree]
    return tree


def _host_copy(tensor: Any) -> Any:
    """The ShardedTensor over host copies of this rank's shards (no collective)."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed.remote_device import _remote_device

    metadata = copy.deepcopy(tensor.metadata())
    for shard_md in metadata.shards_metadata:
        if shard_md.placement is not None:
            shard_md.placement = _remote_device(f"rank:{shard_md.placement.rank()}/cpu")
    mine = {tuple(m.shard_offsets): m for m in metadata.shards_metadata}
    shards = [Shard(s.tensor.detach().to("cpu", copy=True).contiguous(),
                    mine[tuple(s.metadata.shard_offsets)])
              for s in tensor.local_shards()]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, metadata, process_group=tensor._process_group)
