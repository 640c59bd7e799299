"""torchrun's rendezvous for a one-node job: on one address, whatever the hostname resolves to.

``torchrun --standalone`` hosts its rendezvous at ``localhost`` but hands the workers
``MASTER_ADDR=<the FQDN>``, the hostname as name resolution returns it. On a host whose
name resolves to another address (Debian's 127.0.1.1, cluster DNS) the workers dial a
store that listens on 127.0.0.1 only (trainer/stores.py); where it resolves to nothing
they cannot dial at all. Either way every rank sits in ``init_process_group`` until it
times out. One node needs no name: the rendezvous and the workers' store (``--local-addr``
becomes MASTER_ADDR) are both given the address the stores listen on, loopback by default.
Several nodes keep the rendezvous they are given (trainer/launcher.py).
"""

from __future__ import annotations

from trainwatch.contract.env import TORCHRUN_LOCAL_ADDR_ENV
from trainwatch.contract.ports import LOOPBACK


def one_node_args(rdzv_id: str, address: str = LOOPBACK) -> list[str]:
    """torchrun options for a rendezvous of this node alone, hosted and advertised on
    ``address`` (a free port, like ``--standalone``)."""
    host = f"[{address}]" if ":" in address else address
    return ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={host}:0",
            f"--rdzv-id={rdzv_id}", f"--local-addr={address}"]


def pin_standalone(command: list[str], env: dict[str, str]) -> None:
    """A user's own ``torchrun --standalone`` (``trainwatch run``, ``rehearse -- COMMAND``)
    advertises the hostname too, and where that resolves to nothing its workers hang;
    give it loopback through the environment unless it names an address itself. Only the
    launcher's options count: those before the script (the first ``*.py``), which may take
    a ``--standalone`` of its own."""
    launcher: list[str] = []
    for arg in command[1:]:
        if arg.endswith(".py"):
            break
        launcher.append(arg)
    if "--standalone" in launcher and not any(
            a.startswith(("--local-addr", "--local_addr")) for a in launcher):
        env.setdefault(TORCHRUN_LOCAL_ADDR_ENV, LOOPBACK)
