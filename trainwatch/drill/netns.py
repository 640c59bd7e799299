"""Two "hosts" on one machine, for the multi-node drills (trainwatch/drill/nodes.py) and
the multi-node tests: Linux network namespaces joined by a veth pair.

Each node is a network namespace (``tw-n0-<random>``, ``tw-n1-<random>``) with its own
loopback and one end of a veth pair (10.77.0.1/24 and 10.77.0.2/24), so processes in it
see only their own interfaces and reach the other node over the veth, like two machines
on one network. Nothing is routed to or from the host's own interfaces. Processes run
inside with ``node.cmd(...)`` (``ip netns exec``); a thread of this process talks to them
from inside a namespace with ``NetnsWorker`` (a network namespace is per thread). Leaving
``veth_nodes`` (also by an exception or Ctrl-C) SIGKILLs every process left in the
namespaces by PID and deletes them. Needs root and iproute2; ``unavailable()`` says why not.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator

CLONE_NEWNET = 0x40000000
SUBNET = "10.77.0"


@dataclass(frozen=True)
class Node:
    index: int
    netns: str    # namespace name
    ifname: str   # this node's end of the veth pair
    addr: str     # its IPv4 address on the veth

    def cmd(self, *argv: str) -> list[str]:
        """``argv`` run inside this node's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def pids(self) -> list[int]:
        """Every process in the namespace (all ours: we made the namespace)."""
        done = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True,
                              text=True)
        return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def unavailable() -> str | None:
    """Why network-namespace tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` (apt-get install iproute2)"
    probe = f"tw-probe-{secrets.token_hex(3)}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"`ip netns add` failed: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def kill_all(nodes: list[Node], timeout: float = 10.0) -> list[int]:
    """SIGKILL every process left in the nodes' namespaces, by PID; returns those PIDs."""
    killed = []
    for node in nodes:
        for pid in node.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    deadline = time.time() + timeout
    while time.time() < deadline and any(n.pids() for n in nodes):
        time.sleep(0.1)
    return killed


@contextlib.contextmanager
def veth_nodes(count: int = 2) -> Iterator[list[Node]]:
    """``count`` (1 or 2) namespaces joined by a veth pair; on exit every process left in
    them is killed by PID and the namespaces (and with them the veth) are deleted."""
    suffix = secrets.token_hex(3)
    nodes = [Node(i, f"tw-n{i}-{suffix}", f"twv{i}-{suffix}", f"{SUBNET}.{i + 1}")
             for i in range(count)]
    created: list[Node] = []
    try:
        for node in nodes:
            _ip("netns", "add", node.netns)
            created.append(node)
            _ip("-n", node.netns, "link", "set", "lo", "up")
        _ip("link", "add", nodes[0].ifname, "type", "veth", "peer", "name", nodes[-1].ifname)
        for node in nodes:
            _ip("link", "set", node.ifname, "netns", node.netns)
            _ip("-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", node.ifname)
            _ip("-n", node.netns, "link", "set", node.ifname, "up")
        yield nodes
    finally:
        kill_all(created)
        for node in created:
            subprocess.run(["ip", "netns", "del", node.netns], capture_output=True)
        # Both ends left with their namespaces; this only matters if moving one failed.
        subprocess.run(["ip", "link", "del", nodes[0].ifname], capture_output=True)


def _enter(netns: str) -> None:
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {netns}: {os.strerror(errno)}")
    finally:
        os.close(fd)


class NetnsWorker:
    """A thread inside a node's network namespace: ``call(fn, ...)`` runs ``fn`` there
    (sockets it opens belong to that namespace); the rest of the process is unaffected."""

    def __init__(self, node: Node):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"netns-{node.netns}",
                                        initializer=_enter, initargs=(node.netns,))

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._pool.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
