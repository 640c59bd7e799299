"""torchrun's TCP stores on one address, never on every interface.

torch's ``TCPStore`` server listens on all interfaces whatever host it is given (torch
2.13, both backends); it does take a socket already listening (``master_listen_fd``).
So wherever a store server starts (torchrun's rendezvous store in the launcher, the
workers' store in rank 0) the stores are made through a subclass that first binds the
socket to ``$TRAINWATCH_STORE_ADDR``: loopback for one node, the node's training
address (``--local-addr``) for several. ``trainwatch train`` sets it; unset, nothing
changes.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

from trainwatch.contract.env import STORE_ADDR_ENV

# TCPStore's parameters in order (torch.distributed.TCPStore.__init__).
_PARAMS = ("host_name", "port", "world_size", "is_master", "timeout", "wait_for_workers",
           "multi_tenant", "master_listen_fd", "use_libuv")
# The modules that create store servers, each with its own name for the class: in a rank
# (init_process_group's env:// store)...
RANK_CREATORS = ("torch.distributed", "torch.distributed.rendezvous")
# ...and in torchrun (its rendezvous), whose modules a rank need not import.
TORCHRUN_CREATORS = RANK_CREATORS + (
    "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
    "torch.distributed.elastic.utils.distributed")


def bind_stores(address: str | None = None, creators: tuple[str, ...] = RANK_CREATORS) -> None:
    """Make every TCPStore server this process starts (through ``creators``) listen on
    ``address`` (default ``$TRAINWATCH_STORE_ADDR``) only."""
    wanted = address or os.environ.get(STORE_ADDR_ENV)
    if not wanted:
        return
    bind: str = wanted
    import importlib

    import torch.distributed as dist
    base = dist.TCPStore
    if getattr(base, "_trainwatch_bound", None):
        return

    class BoundTCPStore(base):  # type: ignore[misc, valid-type]
        _trainwatch_bound = bind

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.update(zip(_PARAMS, args))
            if kwargs.get("is_master") and kwargs.get("master_listen_fd") is None:
                sock = socket.create_server((bind, int(kwargs.get("port") or 0)),
                                            family=_family(bind), backlog=4096)
                kwargs["port"] = sock.getsockname()[1]
                kwargs["master_listen_fd"] = sock.detach()
            super().__init__(**kwargs)

    for name in creators:
        module = sys.modules.get(name) or importlib.import_module(name)
        if getattr(module, "TCPStore", None) is base:
            module.TCPStore = BoundTCPStore  # type: ignore[attr-defined]


def _family(address: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def torchrun_main() -> None:
    """``python -m trainwatch.trainer.stores ARGS``: torchrun with its stores bound."""
    bind_stores(creators=TORCHRUN_CREATORS)
    from torch.distributed.run import main
    main()


if __name__ == "__main__":
    torchrun_main()
