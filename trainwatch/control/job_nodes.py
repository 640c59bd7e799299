"""A supervised job on several nodes: which node this supervisor is, and who leads.

Every node of a multi-node job runs its own supervisor (``trainwatch run`` or ``alerts
receive`` with a job) on the one run directory the nodes share. Each holds its node's lock
(``RUN_DIR/supervisors/<node>.lock``: one supervisor per node) and supervises only its own
launcher; the leader, node rank 0 (the node that hosts the rendezvous), decides the
job-wide repairs and the others carry them out (``control/repairs.py``). A one-node job
has no ``JobNodes`` and runs as it always has.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import click

from trainwatch.contract.env import NODE_ENV
from trainwatch.errors import ConfigError
from trainwatch.node import node_name

LEADER_RANK = 0  # the node that hosts the rendezvous store leads


@dataclass(frozen=True)
class JobNodes:
    """This supervisor's place in a multi-node job."""

    node: str       # this node's name (--node-name, TRAINWATCH_NODE, the hostname)
    node_rank: int  # 0 .. nnodes-1
    nnodes: int

    @property
    def leader(self) -> bool:
        return self.node_rank == LEADER_RANK

    def journal(self) -> dict[str, Any]:
        return {"node": self.node, "node_rank": self.node_rank, "nnodes": self.nnodes,
                "leader": self.leader}


def node_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--nnodes``, ``--node-rank`` and ``--node-name``: a supervisor of one node of a
    multi-node job (the same values on ``trainwatch run`` and ``alerts receive``)."""
    fn = click.option("--node-name", metavar="NAME",
                      help=f"This node's name in a multi-node job (default: ${NODE_ENV}, else "
                           "the hostname); the ranks, the agent and the journal use it.")(fn)
    fn = click.option("--node-rank", type=click.IntRange(min=0),
                      help="This node's rank in a multi-node job (0 hosts the rendezvous and "
                           "decides the job's repairs).")(fn)
    fn = click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True,
                      help="Nodes of the job: with more than 1, run one supervisor per node "
                           "on the shared run directory (docs/deploy.md, Multi-node).")(fn)
    return fn


def rendezvous_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--rdzv-endpoint``, ``--local-addr`` and ``--min-nnodes``: the reference trainer's
    rendezvous in a multi-node job (the same values on ``trainwatch run`` and ``alerts
    receive``)."""
    fn = click.option("--min-nnodes", type=click.IntRange(min=1), metavar="N",
                      help="Let the job go on with as few as N nodes when others are lost, "
                           "and grow back when they return (the reference trainer; torchrun "
                           "--nnodes N:NNODES; docs/deploy.md, 'A lost node').")(fn)
    fn = click.option("--local-addr", metavar="ADDR",
                      help="The address other nodes reach this one at (the reference "
                           "trainer).")(fn)
    fn = click.option("--rdzv-endpoint", metavar="HOST:PORT",
                      help="A multi-node job's rendezvous (the reference trainer): node 0's "
                           "address and a free port, the same on every node.")(fn)
    return fn


def job_nodes(nnodes: int, node_rank: int | None, name: str | None) -> JobNodes | None:
    """The node's place from the options (None for a one-node job); ConfigError (exit 2)
    naming the option at fault. A given name becomes $TRAINWATCH_NODE, so the agent, the
    journal and the job's ranks this supervisor starts all use it."""
    if name is not None and (not name or name != name.strip()):
        raise ConfigError(f"must be a non-empty name without surrounding spaces, got {name!r}",
                          key="--node-name")
    if nnodes == 1:
        if node_rank not in (None, 0):
            raise ConfigError(f"is {node_rank}, but --nnodes is 1", key="--node-rank")
        if name is not None:
            os.environ[NODE_ENV] = name
        return None
    if node_rank is None:
        raise ConfigError(f"a job of {nnodes} nodes needs this node's rank (0 on the node "
                          "that hosts the rendezvous)", key="--node-rank")
    if node_rank >= nnodes:
        raise ConfigError(f"must be below --nnodes {nnodes}, got {node_rank}", key="--node-rank")
    if name is not None:
        os.environ[NODE_ENV] = name
    return JobNodes(node=node_name(), node_rank=node_rank, nnodes=nnodes)


def rendezvous_args(nodes: JobNodes | None, endpoint: str | None,
                    local_addr: str | None, min_nnodes: int | None = None) -> list[str]:
    """The reference trainer's options for this node's launcher, the same at every start:
    its place, its name and the rendezvous (``trainwatch train``'s own options)."""
    if nodes is None:
        given = [k for k, v in (("--rdzv-endpoint", endpoint), ("--local-addr", local_addr),
                                ("--min-nnodes", min_nnodes)) if v]
        if given:
            raise ConfigError("is for a job of several nodes: give --nnodes too", key=given[0])
        return []
    if not endpoint:
        raise ConfigError(f"a job of {nodes.nnodes} nodes needs the rendezvous: node 0's "
                          "address and a free port, HOST:PORT, the same on every node",
                          key="--rdzv-endpoint")
    args = ["--nnodes", str(nodes.nnodes), "--node-rank", str(nodes.node_rank),
            "--rdzv-endpoint", endpoint, "--node-name", nodes.node]
    args += ["--min-nnodes", str(min_nnodes)] if min_nnodes is not None else []
    return args + (["--local-addr", local_addr] if local_addr else [])
