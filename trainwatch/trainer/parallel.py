"""How the reference trainer's ranks share the model: ``parallel.mode`` (docs/trainer.md).

``ddp``: every rank holds the whole model, DDP all-reduces the gradients, and a checkpoint
is rank 0's whole state. ``fsdp``: FSDP2 ``fully_shard`` over a 1-D device mesh of every
rank (each block a unit of its own, then the root with the embeddings, final norm and tied
head), so each rank holds 1/world of the weights, gradients and AdamW state; a checkpoint
is every rank's shards through DCP (the Checkpointer's sharded path), resumable at another
world size. What differs between the modes is here, so the loop reads the same for both.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from trainwatch.rank.checkpoint import sharded

SHARDED_MODES = ("fsdp",)


def is_sharded(mode: str) -> bool:
    return mode in SHARDED_MODES


def shard(model: torch.nn.Module, device: torch.device, world_size: int) -> Any:
    """``fully_shard`` the GPT in place over a 1-D mesh of every rank (a collective-free
    setup; call before building the optimizer: FSDP2 swaps the parameters for DTensors).
    Returns the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

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


def load_sharded(path: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any, group: Any) -> None:
    """A sharded (DCP) checkpoint into the sharded model, optimizer and schedule (every rank;
    DCP reshards when the world size changed)."""
    loaded = sharded.load(path, {"model": model, "optimizer": optimizer,
                                 "scheduler": scheduler}, group)
    scheduler.load_state_dict(loaded["scheduler"])


def sdc_note(mode: str, replica_every: int, reduction_every: int) -> str | None:
    """What the silent-data-corruption checks do in this mode, when they differ from
    what the config asks for (docs/sdc.md); None when they run as configured."""
    if not is_sharded(mode) or not (replica_every > 0 or reduction_every > 0):
        return None
    return ("parallel.mode fsdp: replica digests and the reduction checksum are off (each "
            "rank holds a different shard: there are no replicas to compare, and no DDP "
            "all-reduce to carry a checksum; docs/sdc.md)")
