"""Tell sharded state (saved through DCP) from state no checkpoint can hold (bad input).

A DTensor (FSDP2's ``fully_shard``, tensor parallel) and a ShardedTensor (FSDP1's sharded
state dict, what ``get_model_state_dict`` gives of a ``FullyShardedDataParallel`` model) are
this rank's shards only: such state is saved by every rank through
torch.distributed.checkpoint (sharded.py, sharded_save.py), so the looks here answer
"sharded?" for it. An FSDP1 model or an optimizer over its FlatParameters is sharded state
too: DCP's state-dict API turns them into ShardedTensors keyed by parameter name. What
neither path can hold is refused: a FlatParameter or ShardedTensor in a tree of its own (not
through the model), another tensor subclass, a meta tensor, an object that does not pickle.
Before, such state failed every async save ("cannot copy") or sealed rank 0's shards only;
now the first save and the first resume look at the state once (a walk over its tensors, no
copy, no collective) and stop the rank with a ConfigError naming the first offending key,
its type and the fix: the rank's status says bad input, ``trainwatch run`` exits 2 and
nothing is restarted. Plain tensors (CUDA ones too), ``nn.Parameter`` and Python values
pass untouched.
"""

from __future__ import annotations

import pickle
import sys
from typing import Any, Iterator

import torch

from trainwatch.errors import ConfigError

SHARDED_FIX = ("pass the sharded model and its optimizer themselves (model=..., "
               "optimizer=...: FSDP2's DTensors and FSDP1's sharded state dict are saved "
               "through torch.distributed.checkpoint (DCP) by every rank), or save this state "
               "with DCP in your loop and declare each save with tel.checkpoint_saved(path, "
               "step); see docs/checkpoints.md, \"Sharded models\"")
_SCALARS = (int, float, str, bool, bytes, complex, type(None), torch.dtype, torch.device,
            torch.Size)


class UnsaveableState(ConfigError):
    """State a checkpoint would not hold whole; ``key`` names where, ``what`` what it is."""

    def __init__(self, key: str, what: str, fix: str):
        super().__init__(f"cannot checkpoint {key}: {what}: {fix}")
        self.key, self.what = key, what


def check_trees(state: dict[str, Any]) -> bool:
    """True when the state trees (``name -> state_dict`` and plain values) hold a DTensor
    or ShardedTensor (sharded: saved through DCP); UnsaveableState for the first tensor or
    object that no checkpoint can hold."""
    sharded = False
    for key, value in leaves(state, ""):
        if isinstance(value, torch.Tensor):
            if is_sharded_tensor(value):
                sharded = True
                continue
            what = describe_tensor(value)
            if what is not None:
                raise UnsaveableState(key, what, SHARDED_FIX)
        elif not isinstance(value, _SCALARS):
            _check_pickles(key, value)
    return sharded


def check_objects(state: dict[str, Any]) -> bool:
    """True when a model or optimizer given by keyword (or a container) is sharded: holds
    DTensors (FSDP2) or is FSDP1 (a FullyShardedDataParallel module, an optimizer over its
    FlatParameters), saved through DCP; UnsaveableState for another tensor no checkpoint can
    hold. Other objects are left to ``check_trees`` (no ``state_dict`` is taken here: under
    FSDP1 that is a collective)."""
    sharded = False
    for name, obj in state.items():
        if isinstance(obj, torch.nn.Module):
            found = _first_tensor_not_whole(
                (f"{name}.{key}", t) for key, t in [*obj.named_parameters(),
                                                    *obj.named_buffers()])
        elif isinstance(obj, torch.optim.Optimizer):
            found = _sharded_optimizer(name, obj)
        elif isinstance(obj, (dict, list, tuple)):
            found = _first_tensor_not_whole(leaves(obj, name))
        else:
            found = None
        if found is not None:
            raise UnsaveableState(*found, SHARDED_FIX)
        sharded = sharded or _holds_shards(obj)
    return sharded


def is_dtensor(tensor: Any) -> bool:
    dtensor = _loaded("torch.distributed.tensor", "DTensor")
    return dtensor is not None and isinstance(tensor, dtensor)


def is_sharded_tensor(tensor: Any) -> bool:
    """A DTensor, or a ShardedTensor (FSDP1's sharded state dict): DCP saves either."""
    if is_dtensor(tensor):
        return True
    sharded = _loaded("torch.distributed._shard.sharded_tensor", "ShardedTensor")
    return sharded is not None and isinstance(tensor, sharded)


def is_fsdp1(module: torch.nn.Module) -> bool:
    """The module is, or holds, FSDP1's FullyShardedDataParallel."""
    fsdp1 = _loaded("torch.distributed.fsdp.fully_sharded_data_parallel",
                    "FullyShardedDataParallel")
    return fsdp1 is not None and any(isinstance(m, fsdp1) for m in module.modules())


def _is_flat_param(tensor: Any) -> bool:
    return bool(getattr(tensor, "_is_flat_param", False))


def _holds_shards(obj: Any) -> bool:
    if isinstance(obj, torch.nn.Module):
        return is_fsdp1(obj) or any(is_dtensor(p) for p in obj.parameters())
    if isinstance(obj, torch.optim.Optimizer):
        return any(is_dtensor(p) or _is_flat_param(p)
                   for g in obj.param_groups for p in g.get("params", []))
    if isinstance(obj, (dict, list, tuple)):
        return any(is_sharded_tensor(v) for _, v in leaves(obj, ""))
    return False


def describe_tensor(tensor: torch.Tensor) -> str | None:
    """What a tensor is when a checkpoint cannot copy it whole, else None."""
    kind = type(tensor)
    dtensor = _loaded("torch.distributed.tensor", "DTensor")
    if dtensor is not None and isinstance(tensor, dtensor):
        return _dtensor_text(tensor)
    sharded = _loaded("torch.distributed._shard.sharded_tensor", "ShardedTensor")
    if sharded is not None and isinstance(tensor, sharded):
        return ("ShardedTensor (this rank's shards of an FSDP1 sharded or local state dict)")
    if getattr(tensor, "_is_flat_param", False):
        return "FlatParameter (FSDP1's flattened shard of this rank's parameters)"
    if kind.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        return (f"tensor subclass {kind.__module__}.{kind.__qualname__} (a wrapper whose data "
                "trainwatch cannot copy whole)")
    if tensor.is_meta:
        return "meta tensor (it has no data: a model built on the meta device, not materialized)"
    return None


def _dtensor_text(tensor: Any) -> str:
    mesh = tensor.device_mesh
    names = mesh.mesh_dim_names
    where = f"mesh {tuple(names)!r}" if names else f"a mesh of shape {tuple(mesh.shape)}"
    placements = list(tensor.placements)
    texts = [f"Shard({p.dim})" if p.is_shard() else repr(p) for p in placements]
    how = ("sharded" if any(p.is_shard() for p in placements)
           else "partial" if any(p.is_partial() for p in placements) else "replicated")
    with_ = texts[0] if len(texts) == 1 else f"({', '.join(texts)})"
    return f"DTensor ({how} over {where} with {with_})"


def _sharded_optimizer(name: str, optimizer: torch.optim.Optimizer) -> tuple[str, str] | None:
    """An optimizer's parameters: FSDP1's FlatParameters are saved through its model."""
    params = ((f"{name}.param_groups[{g}].params[{i}]", p)
              for g, group in enumerate(optimizer.param_groups)
              for i, p in enumerate(group.get("params", [])) if not _is_flat_param(p))
    return _first_tensor_not_whole(params)


def _first_tensor_not_whole(items: Iterator[tuple[str, Any]]) -> tuple[str, str] | None:
    """The first tensor neither whole nor sharded state DCP saves (a module's FlatParameter
    is FSDP1's: its model's sharded state dict holds it)."""
    for key, value in items:
        if _is_flat_param(value):
            continue
        if isinstance(value, torch.Tensor) and not is_sharded_tensor(value):
            what = describe_tensor(value)
            if what is not None:
                return key, what
    return None


def leaves(tree: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf of nested dicts, lists and tuples."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        for i, value in enumerate(tree):
            yield from leaves(value, f"{prefix}[{i}]")
    else:
        yield prefix, tree


def _check_pickles(key: str, value: Any) -> None:
    try:
        pickle.dumps(value)
    except Exception as exc:
        kind = type(value)
        raise UnsaveableState(
            key, f"{kind.__module__}.{kind.__qualname__} cannot be pickled "
                 f"({type(exc).__name__}: {exc})",
            "pass what a checkpoint can hold: tensors, numbers, strings, containers of them, "
            "or an object with state_dict() and load_state_dict()") from None


def _loaded(module: str, name: str) -> Any:
    """``module.name`` if the job imported that module (else none of its tensors exist:
    importing it here would only slow the first save down)."""
    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None
