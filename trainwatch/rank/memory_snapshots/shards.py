"""This rank's own shards of sharded (FSDP2, DTensor) state in a memory snapshot, and back.

A DTensor is this rank's shard (``to_local()``) and where it sits in the whole: the device
mesh, its placements, the global shape and stride. A snapshot keeps the local tensors only
(the host copy is of them: nothing is gathered, no collective) and a ``record`` of the
rest, in plain values that ``torch.load(weights_only=True)`` reads. A resume at the same
world size and mesh checks the record against the job's own DTensors (``fit``: the mesh,
this rank's coordinate in it, every tensor's placements, shape, stride and dtype) and
rebuilds each DTensor from its local shard on the job's mesh (``rebuild``:
``DTensor.from_local`` with the recorded shape and stride, no collective either), for
torch's ``set_model_state_dict`` / ``set_optimizer_state_dict`` to load
(checkpoint/sharded.py ``put_back``). Anything else is a named mismatch and the job resumes
from its durable (DCP) checkpoint, which reshards.
"""

from __future__ import annotations

from typing import Any

import torch

from trainwatch.rank.checkpoint.whole_state import is_dtensor, leaves


class Mismatch(ValueError):
    """The snapshot's shards do not fit this job's sharded state; the message says where."""


def _children(obj: Any, key: str, walk: Any) -> Any:
    """``obj`` with ``walk(child, its dotted key)`` applied to each child of a dict, list or
    tuple (the keys ``whole_state.leaves`` names); any other value as it is."""
    if isinstance(obj, dict):
        return type(obj)((k, walk(v, f"{key}.{k}" if key else str(k))) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(walk(v, f"{key}[{i}]") for i, v in enumerate(obj))
    return obj


def split(trees: Any) -> tuple[Any, dict[str, Any]]:
    """``trees`` with each DTensor replaced by its local shard, and the record of where
    each sits (by dotted key, as ``whole_state.leaves`` names them)."""
    meshes: dict[int, int] = {}
    record: dict[str, Any] = {"meshes": [], "tensors": {}}

    def walk(obj: Any, key: str) -> Any:
        if isinstance(obj, torch.Tensor) and is_dtensor(obj):
            local = obj.to_local()
            record["tensors"][key] = _describe(obj, local, meshes, record["meshes"])
            return local
        return _children(obj, key, walk)

    return walk(trees, ""), record


def describe(trees: Any) -> dict[str, Any]:
    """The record of the DTensors of ``trees`` (the job's own, at a resume)."""
    return split(trees)[1]


def fit(record: dict[str, Any] | None, live: Any, saved: Any) -> None:
    """Mismatch unless the snapshot (``record``, local tensors ``saved``) is of this job's
    sharded state ``live`` (its trees with DTensors; None: the job's state is not
    sharded). Only the trees ``live`` holds are compared tensor by tensor; every mesh the
    snapshot used must be one of theirs (the optimizer's state is checked through its
    model's parameters, so looking at it does not have to initialize it)."""
    mine = describe(live) if live is not None else {"meshes": [], "tensors": {}}
    if record is None:
        if mine["tensors"]:
            raise Mismatch("the snapshot holds whole (data-parallel) state; this job's is "
                           "sharded (DTensor)")
        return
    if not mine["tensors"]:
        raise Mismatch("the snapshot holds this rank's shards of sharded (DTensor) state; "
                       "this job's state is not sharded")
    _mesh_map(record, mine)
    locals_ = dict(leaves(saved, ""))
    for name in live:
        ours = {k: v for k, v in mine["tensors"].items() if _under(k, name)}
        theirs = {k: v for k, v in record["tensors"].items() if _under(k, name)}
        for key in sorted(ours.keys() - theirs.keys())[:1]:
            raise Mismatch(f"{key}: this job's DTensor is not in the snapshot")
        for key in sorted(theirs.keys() - ours.keys())[:1]:
            raise Mismatch(f"{key}: in the snapshot, not in this job's {name}")
        for key, want in ours.items():
            _same_tensor(key, theirs[key], want)
    for key, entry in record["tensors"].items():
        local = locals_.get(key)
        if not isinstance(local, torch.Tensor):
            raise Mismatch(f"{key}: the snapshot holds no local shard for it")
        if list(local.shape) != entry["local_shape"] or str(local.dtype) != entry["dtype"]:
            raise Mismatch(f"{key}: the snapshot's local shard is {list(local.shape)} "
                           f"{local.dtype}, its record says {entry['local_shape']} "
                           f"{entry['dtype']}")


def rebuild(saved: Any, record: dict[str, Any], live: Any) -> Any:
    """``saved`` (the snapshot's trees, local shards) with each recorded key a DTensor again,
    on this job's mesh (call ``fit`` first)."""
    mine = describe(live)
    by_index = _mesh_map(record, mine)
    objects = _mesh_objects(live)
    from torch.distributed.tensor import DTensor

    def walk(obj: Any, key: str) -> Any:
        entry = record["tensors"].get(key)
        if entry is not None and isinstance(obj, torch.Tensor):
            return DTensor.from_local(obj, objects[by_index[entry["mesh"]]],
                                      [decode(p) for p in entry["placements"]],
                                      run_check=False, shape=torch.Size(entry["shape"]),
                                      stride=tuple(entry["stride"]))
        return _children(obj, key, walk)

    return walk(saved, "")


# ---------------------------------------------------------------------------- placements

def encode(placement: Any) -> list[Any]:
    """A placement as plain values (``decode`` gives it back)."""
    from torch.distributed.tensor.placement_types import (Partial, Replicate, Shard,
                                                          _StridedShard)

    kind = type(placement)
    if kind is _StridedShard:
        return ["_StridedShard", int(placement.dim), int(placement.split_factor)]
    if kind is Shard:
        return ["Shard", int(placement.dim)]
    if kind is Replicate:
        return ["Replicate"]
    if kind is Partial:
        return ["Partial", str(placement.reduce_op)]
    return ["?", repr(placement)]


def decode(value: list[Any]) -> Any:
    from torch.distributed.tensor.placement_types import (Partial, Replicate, Shard,
                                                          _StridedShard)

    kind = value[0]
    if kind == "_StridedShard":
        return _StridedShard(value[1], split_factor=value[2])
    if kind == "Shard":
        return Shard(value[1])
    if kind == "Replicate":
        return Replicate()
    if kind == "Partial":
        return Partial(value[1])
    raise Mismatch(f"placement {value[-1]} cannot be rebuilt from a snapshot")


def text(placements: list[list[Any]]) -> str:
    parts = [f"{p[0]}({', '.join(str(v) for v in p[1:])})" for p in placements]
    return f"({', '.join(parts)})"


# ---------------------------------------------------------------------------- internals

def _describe(tensor: Any, local: torch.Tensor, meshes: dict[int, int],
              listed: list[dict[str, Any]]) -> dict[str, Any]:
    mesh = tensor.device_mesh
    index = meshes.get(id(mesh))
    if index is None:
        names = mesh.mesh_dim_names
        coordinate = mesh.get_coordinate()
        index = meshes[id(mesh)] = len(listed)
        listed.append({"shape": list(mesh.shape), "dim_names": list(names) if names else None,
                       "device_type": mesh.device_type,
                       "coordinate": list(coordinate) if coordinate is not None else None})
    return {"mesh": index, "placements": [encode(p) for p in tensor.placements],
            "shape": list(tensor.shape), "stride": list(tensor.stride()),
            "local_shape": list(local.shape), "dtype": str(tensor.dtype)}


def _mesh_map(record: dict[str, Any], mine: dict[str, Any]) -> dict[int, int]:
    """The snapshot's mesh index -> this job's, matched through the tensors both have;
    Mismatch when a mesh differs or one of the snapshot's has no counterpart."""
    out: dict[int, int] = {}
    for key, ours in mine["tensors"].items():
        theirs = record["tensors"].get(key)
        if theirs is None:
            continue
        saved, live = record["meshes"][theirs["mesh"]], mine["meshes"][ours["mesh"]]
        if saved != live:
            raise Mismatch(f"the snapshot's mesh is {_mesh_text(saved)}, this job's "
                           f"{_mesh_text(live)}")
        out[theirs["mesh"]] = ours["mesh"]
    for index, mesh in enumerate(record["meshes"]):
        if index not in out:
            raise Mismatch(f"the snapshot's mesh {_mesh_text(mesh)} is not one of this job's")
    return out


def _same_tensor(key: str, saved: dict[str, Any], live: dict[str, Any]) -> None:
    for field, what in (("placements", "placements"), ("shape", "global shape"),
                        ("stride", "stride"), ("local_shape", "local shard"),
                        ("dtype", "dtype")):
        if saved[field] != live[field]:
            show = text if field == "placements" else str
            raise Mismatch(f"{key}: {what} {show(saved[field])} in the snapshot, "
                           f"{show(live[field])} in this job")


def _mesh_text(mesh: dict[str, Any]) -> str:
    names = f" {tuple(mesh['dim_names'])}" if mesh.get("dim_names") else ""
    return (f"{mesh['device_type']} shape {mesh['shape']}{names}, this rank at "
            f"{mesh['coordinate']}")


def _mesh_objects(live: Any) -> list[Any]:
    """This job's DeviceMesh objects, in the order ``describe`` numbers them."""
    seen: dict[int, Any] = {}
    for _, value in leaves(live, ""):
        if isinstance(value, torch.Tensor) and is_dtensor(value):
            seen.setdefault(id(value.device_mesh), value.device_mesh)
    return list(seen.values())


def _under(key: str, name: str) -> bool:
    return key == name or key.startswith((f"{name}.", f"{name}["))

