"""Start the corpus job and stop it: one node (``torchrun --standalone``), or two nodes on
one machine, each a network namespace joined by a veth pair (trainwatch/drill/netns.py),
for a case whose fault is between nodes (``Case.nnodes == 2``).

On two nodes each runs its own ``trainwatch run --nnodes 2 --node-rank R --node-name NS``
around its own torchrun (c10d rendezvous on node 0's veth address, gloo over the veth), on
the shared run directory, as docs/deploy.md's multi-node jobs do. The nodes' names,
namespaces, interfaces and addresses go into ``WORKDIR/nodes.json`` for the case's
runner-side hooks (the interface to slow). On the way out (an error and Ctrl-C included)
every supervisor is stopped, every process left in the namespaces SIGKILLed by PID and
the namespaces (with their veth and any qdisc on it) deleted.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Iterator

from trainwatch.drill import netns
from trainwatch.drill.corpus.case import Case
from trainwatch.drill.runner import stop_tree
from trainwatch.rundir.run_dir import RunDir

NODES_FILE = "nodes.json"
RDZV_PORT = 29400   # node 0's rendezvous; each namespace has ports of its own
STOP_GRACE = 10.0
JOB = ["-m", "trainwatch.drill.corpus.job"]


def supervisor(run: RunDir, files: dict[str, Path]) -> list[str]:
    return [sys.executable, "-m", "trainwatch", "run", "--run-dir", str(run.root), "--no-live",
            "--dry-run", "--thresholds", str(files["thresholds"]),
            "--agent-config", str(files["agent"])]


def command(case: Case, run: RunDir, files: dict[str, Path]) -> list[str]:
    """One node's command: ``trainwatch run -- torchrun --standalone``."""
    return [*supervisor(run, files), "--", sys.executable, "-m", "torch.distributed.run",
            "--standalone", f"--nproc-per-node={case.nproc}", "--max-restarts=0",
            *case.launcher_args, *JOB]


def node_command(case: Case, run: RunDir, files: dict[str, Path], nodes: list[netns.Node],
                 node: netns.Node) -> list[str]:
    """Node ``node``'s command of a multi-node case, run inside its namespace."""
    return node.cmd(
        *supervisor(run, files), "--nnodes", str(len(nodes)), "--node-rank", str(node.index),
        "--node-name", node.netns, "--", sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={len(nodes)}", f"--nproc-per-node={case.nproc}", "--max-restarts=0",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={nodes[0].addr}:{RDZV_PORT}",
        f"--rdzv-id={run.root.name}", f"--rdzv-conf=is_host={int(node.index == 0)}",
        f"--local-addr={node.addr}", *case.launcher_args, *JOB)


def node_names(work: Path) -> list[str] | None:
    """The node names of a multi-node case (None on one node)."""
    path = work / NODES_FILE
    return [n["name"] for n in json.loads(path.read_text())] if path.exists() else None


@contextlib.contextmanager
def started(case: Case, run: RunDir, files: dict[str, Path], env: dict[str, str],
            work: Path) -> Iterator[list[subprocess.Popen]]:
    """The job's supervisors (one per node), stopped by PID on the way out."""
    procs: list[subprocess.Popen] = []

    def start(cmd: list[str], extra: dict[str, str]) -> None:
        with open(run.drill_log, "ab") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env={**env, **extra},
                                          start_new_session=True))

    def stop() -> None:
        for proc in procs:
            if proc.poll() is None:
                stop_tree(proc, STOP_GRACE)

    if case.nnodes == 1:
        try:
            start(command(case, run, files), {})
            yield procs
        finally:
            stop()
        return
    with netns.veth_nodes(case.nnodes) as nodes:
        try:
            (work / NODES_FILE).write_text(json.dumps(
                [{"name": n.netns, "netns": n.netns, "ifname": n.ifname, "addr": n.addr}
                 for n in nodes]))
            for node in nodes:
                start(node_command(case, run, files, nodes, node),
                      {"GLOO_SOCKET_IFNAME": node.ifname, "OMP_NUM_THREADS": "1"})
            yield procs
        finally:
            stop()
            netns.kill_all(nodes)  # what escaped its supervisor, still by PID
