"""How the reference trainer's ranks share the model: ``parallel.mode`` (docs/trainer.md).

``ddp``: every rank holds the whole model, DDP all-reduces the gradients, and a checkpoint
is rank 0's whole state. ``fsdp``: FSDP2 ``fully_shard`` over a 1-D device mesh of every
rank (each block a unit of its own, then the root with the embeddings, final norm and tied
head), so each rank holds 1/world of the weights, gradients and AdamW state; a checkpoint
is every rank's shards through DCP (the Checkpointer's sharded path), resumable at another
world size. ``hsdp``: the same over a 2-D mesh (replicas x ``shard_size``): each group of
``shard_size`` consecutive ranks holds one sharded copy, and rank r's shard is replicated
on every rank with the same ``r % shard_size``. What differs between the modes is here,
so the loop reads the same for all three.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from trainwatch.rank.checkpoint import sharded
from trainwatch.trainer.config import ParallelConfig, check_world_size

SHARDED_MODES = ("fsdp", "hsdp")


def is_sharded(mode: str) -> bool:
    return mode in SHARDED_MODES


def shard(model: torch.nn.Module, device: torch.device, world_size: int,
          cfg: ParallelConfig) -> Any:
    """``fully_shard`` the GPT in place over the mode's mesh (call before building the
    optimizer: FSDP2 swaps the parameters for DTensors). Returns the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    check_world_size(cfg, world_size)
    if cfg.mode == "hsdp":
        assert cfg.shard_size is not None, "validated: hsdp has a shard_size"
        mesh = init_device_mesh(device.type, (world_size // cfg.shard_size, cfg.shard_size),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the rest: embeddings, final norm, the tied head
    return mesh


def wrap(model: torch.nn.Module, mode: str, device: torch.device, distributed: bool
         ) -> torch.nn.Module:
    """The module the loop calls: DDP around the model, or the (already sharded) model."""
    if not distributed or is_sharded(mode):
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


@contextlib.contextmanager
def no_sync(module: torch.nn.Module, sync: bool) -> Iterator[None]:
    """Hold back the gradient reduction on a micro-step that is not the last one (DDP's
    ``no_sync``, FSDP2's ``set_requires_gradient_sync``)."""
    if sync:
        yield
    elif hasattr(module, "no_sync"):
        with module.no_sync():
            yield
    elif hasattr(module, "set_requires_gradient_sync"):
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    else:
        yield


def global_norm(norm: torch.Tensor) -> torch.Tensor:
    """``clip_grad_norm_``'s total norm as a plain tensor: over sharded gradients it is a
    DTensor, which the telemetry's thread must never read (that would be a collective)."""
    if hasattr(norm, "full_tensor"):
        return norm.full_tensor()  # every rank, in the loop: one tiny all-reduce
    return norm


def checkpoint_trees(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     scheduler: Any, mode: str) -> dict[str, Any]:
    """What a checkpoint holds of model, optimizer and schedule: their ``state_dict()``s,
    or, sharded, their DCP state dicts (keyed by parameter name, so another world size can
    load them)."""
    if is_sharded(mode):
        return sharded.state_dicts({"model": model, "optimizer": optimizer,
                                    "scheduler": scheduler})
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict()}


def load_sharded(restored: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any, group: Any) -> None:
    """A sharded checkpoint into the sharded model, optimizer and schedule (every rank): a
    DCP one (DCP reshards when the world size changed), or a memory snapshot's shards
    (rebuilt as DTensors on this job's mesh by the checkpointer)."""
    objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    if restored.manifest.get("sharded"):
        sharded.put_back(objects, restored.shared)
        scheduler.load_state_dict(restored.shared["scheduler"])
        return
    loaded = sharded.load(restored.path, objects, group)
    scheduler.load_state_dict(loaded["scheduler"])


def live_trees(model: torch.nn.Module, mode: str) -> Callable[[], dict[str, Any]] | None:
    """What a memory snapshot of sharded state is checked against (None: not sharded)."""
    if not is_sharded(mode):
        return None
    return lambda: sharded.models_of({"model": model})


def replica_group(cfg: ParallelConfig, rank: int) -> int | None:
    """The replica digests' group of this rank (docs/sdc.md): every rank under DDP, the
    ranks holding the same shard under HSDP; None under FSDP, where no two ranks hold the
    same thing."""
    if cfg.mode == "hsdp":
        assert cfg.shard_size is not None, "validated: hsdp has a shard_size"
        return rank % cfg.shard_size
    return None if cfg.mode == "fsdp" else 0


def sdc_note(cfg: ParallelConfig, replica_every: int, reduction_every: int) -> str | None:
    """What the silent-data-corruption checks do in this mode, when it is not what the
    config asks for (docs/sdc.md); None when they run as configured."""
    if cfg.mode == "fsdp" and (replica_every > 0 or reduction_every > 0):
        return ("parallel.mode fsdp: replica digests and the reduction checksum are off (each "
                "rank holds a different shard: there are no replicas to compare, and no DDP "
                "all-reduce to carry a checksum; docs/sdc.md)")
    if cfg.mode == "hsdp" and reduction_every > 0:
        replicas = (f"; replica digests compare the replicas of each shard (ranks r with the "
                    f"same r % {cfg.shard_size})" if replica_every > 0 else "")
        return ("parallel.mode hsdp: the reduction checksum is off (it rides DDP's "
                f"all-reduce){replicas}; docs/sdc.md")
    return None
