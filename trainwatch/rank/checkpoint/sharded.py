"""Sharded (FSDP2's DTensor, FSDP1's) training state in and out of torch.distributed.checkpoint.

A model sharded with ``fully_shard`` holds DTensors, one wrapped in FSDP1's
``FullyShardedDataParallel`` FlatParameters (its sharded state dict: ShardedTensors): each
rank has its shard only, so no rank can write the whole state and none should gather it. Such state goes through DCP
(``torch.distributed.checkpoint.state_dict``): models and optimizers as their DCP state
dicts (keyed by parameter name, so another world size or mesh can load them), everything
else given by keyword as its ``state_dict()`` or itself; DCP writes each rank's shards and
pickles plain values (sharded_save.py writes the checkpoint). On resume the same objects
give DCP the tensors to load into, and ``set_state_dict`` puts them back: DCP reshards when
the world size or mesh changed. docs/checkpoints.md, "Sharded models".
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from trainwatch.errors import ConfigError
from trainwatch.rank.checkpoint.whole_state import is_dtensor, is_sharded_tensor, leaves

RESHARD_FIX = ("resume with the model and optimizer built as when the checkpoint was written "
               "(same parameter names and shapes; the world size and mesh may differ), or "
               "start a new run directory")


def _model_of(optimizer: torch.optim.Optimizer, models: dict[str, torch.nn.Module],
              name: str) -> torch.nn.Module:
    """The model whose parameters the optimizer steps (DCP keys its state by their names)."""
    params = {id(p) for g in optimizer.param_groups for p in g.get("params", [])}
    for model in models.values():
        if any(id(p) in params for p in model.parameters()):
            return model
    raise ConfigError(f"cannot checkpoint {name}: a sharded optimizer needs its model passed "
                      "too (Checkpoints keys its state by the model's parameter names): pass "
                      "model=... beside it", key=name)


def _sole_optimizers(state: dict[str, Any]) -> dict[str, str]:
    """{model name: optimizer name} of each model stepped by exactly one optimizer of
    ``state``: their DCP state dicts are taken (and put back) in one call, which looks at
    the model once instead of twice (``_verify_options`` walks every parameter)."""
    models = {k: v for k, v in state.items() if isinstance(v, torch.nn.Module)}
    stepping: dict[str, list[str]] = {}
    for name, value in state.items():
        if isinstance(value, torch.optim.Optimizer) and name != "data":
            model = _model_of(value, models, name)
            owner = next(k for k, v in models.items() if v is model)
            stepping.setdefault(owner, []).append(name)
    return {model: names[0] for model, names in stepping.items() if len(names) == 1}


def state_dicts(state: dict[str, Any]) -> dict[str, Any]:
    """DCP state dicts of the objects given by keyword (``data`` left out: it is per rank)."""
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         get_state_dict)

    models = {k: v for k, v in state.items() if isinstance(v, torch.nn.Module)}
    paired = _sole_optimizers(state)
    taken: dict[str, Any] = {}
    for model_name, optimizer_name in paired.items():
        taken[model_name], taken[optimizer_name] = get_state_dict(state[model_name],
                                                                  state[optimizer_name])
    out: dict[str, Any] = {}
    for name, value in state.items():
        if name == "data":
            continue
        if name in taken:
            out[name] = taken[name]
        elif isinstance(value, torch.nn.Module):
            out[name] = get_model_state_dict(value)
        elif isinstance(value, torch.optim.Optimizer):
            out[name] = get_optimizer_state_dict(_model_of(value, models, name), value)
        elif hasattr(value, "state_dict"):
            out[name] = value.state_dict()
        elif isinstance(value, (dict, list)):
            out[name] = copy.copy(value)  # DCP loads into it: not into the caller's own
        else:
            out[name] = value
    return out


def load(path: Path, state: dict[str, Any], group: Any = None) -> dict[str, Any]:
    """Load checkpoint ``path`` (DCP layout) into the objects of ``state`` in place (DCP
    reshards); returns {name: loaded value} of each (``data`` left out). A checkpoint that
    does not fit the objects is bad input (ConfigError naming it and the way out)."""
    import torch.distributed.checkpoint as dcp

    wanted = {k: v for k, v in state.items() if k != "data"}
    template = state_dicts(wanted)
    try:
        dcp.load(template, checkpoint_id=str(path), process_group=group)
    except Exception as exc:  # a key or shape the checkpoint lacks: DCP raises it on all ranks
        raise ConfigError(f"cannot load the sharded checkpoint into this job's "
                          f"{', '.join(wanted)}: {_first_line(exc)}; {RESHARD_FIX}",
                          file=str(path)) from None
    put_back(wanted, template)
    return template


def put_back(objects: dict[str, Any], trees: dict[str, Any]) -> None:
    """Load DCP state dicts (DTensors on the job's mesh: loaded by DCP, or rebuilt from a
    memory snapshot's shards) into the models and optimizers of ``objects``, with torch's
    ``set_state_dict`` (a model and its one optimizer together) or ``set_model_state_dict``
    / ``set_optimizer_state_dict`` (default options: every rank loads its own shards, no
    collective). Other objects are the caller's to load."""
    from torch.distributed.checkpoint.state_dict import (set_model_state_dict,
                                                         set_optimizer_state_dict,
                                                         set_state_dict)

    models = {k: v for k, v in objects.items() if isinstance(v, torch.nn.Module)}
    paired = {m: o for m, o in _sole_optimizers(objects).items() if m in trees and o in trees}
    for model_name, optimizer_name in paired.items():
        set_state_dict(objects[model_name], objects[optimizer_name],
                       model_state_dict=trees[model_name],
                       optim_state_dict=trees[optimizer_name])
    done = {*paired, *paired.values()}
    for name, value in objects.items():
        if name not in trees or name in done:
            continue
        if isinstance(value, torch.nn.Module):
            set_model_state_dict(value, trees[name])
        elif isinstance(value, torch.optim.Optimizer):
            set_optimizer_state_dict(_model_of(value, models, name), value, trees[name])


def models_of(objects: dict[str, Any]) -> dict[str, Any]:
    """The DCP state dicts of the models among ``objects``: what a memory snapshot of
    sharded state is checked against (an optimizer's would be initialized by looking)."""
    return state_dicts({k: v for k, v in objects.items() if isinstance(v, torch.nn.Module)})


def layout(trees: dict[str, Any]) -> dict[str, Any]:
    """What the manifest records of sharded state: the device mesh and every DTensor's
    placements, by dotted key (``model.0.weight: ["Shard(0)"]``); of an FSDP1
    ShardedTensor, its chunks' offsets and ranks (``["rows 0-21 on rank 0", ...]``)."""
    placements: dict[str, list[str]] = {}
    mesh: dict[str, Any] | None = None
    for key, value in leaves(trees, ""):
        if isinstance(value, torch.Tensor) and is_sharded_tensor(value) and not is_dtensor(
                value):
            placements[key] = _chunks(value)
        elif isinstance(value, torch.Tensor) and is_dtensor(value):
            placements[key] = [_placement(p) for p in value.placements]
            if mesh is None:
                device_mesh = value.device_mesh
                names = device_mesh.mesh_dim_names
                mesh = {"shape": list(device_mesh.shape), "device_type": device_mesh.device_type,
                        "dim_names": list(names) if names else None}
    return {"mesh": mesh, "placements": placements}


def local(tree: Any) -> Any:
    """``tree`` with each DTensor as this rank's local shard, each ShardedTensor as the list
    of its local shards (checks that must not start a collective, e.g. the NaN/Inf guard,
    look at these)."""
    if isinstance(tree, torch.Tensor):
        if is_dtensor(tree):
            return tree.to_local()
        if is_sharded_tensor(tree):
            return [shard.tensor for shard in tree.local_shards()]
        return tree
    if isinstance(tree, dict):
        return {k: local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return [local(v) for v in tree]
    return tree


def _chunks(tensor: Any) -> list[str]:
    """Where each chunk of a ShardedTensor sits: its offsets, sizes and rank."""
    out = []
    for shard in tensor.metadata().shards_metadata:
        where = ", ".join(f"{o}:{o + n}" for o, n in zip(shard.shard_offsets, shard.shard_sizes))
        rank = shard.placement.rank() if shard.placement is not None else None
        out.append(f"[{where}] on rank {rank}")
    return out


def _placement(p: Any) -> str:
    if p.is_shard():
        return f"Shard({p.dim})"
    return "Replicate()" if p.is_replicate() else "Partial()" if p.is_partial() else repr(p)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"
