"""The name of the node a process runs on, as every part of trainwatch labels it.

``TRAINWATCH_NODE`` wins over the hostname: a Kubernetes pod's hostname is the pod's
name, not the node's, and machines that share a hostname (network namespaces,
containers with a fixed hostname) would otherwise look like one node. The ranks
(status ``node``), the journal (``host``) and the agent (``node`` label) must agree,
because the agent keeps only the ranks whose ``node`` is its own.
"""

from __future__ import annotations

import functools
import os
import socket

from trainwatch.contract.env import NODE_ENV


def node_name() -> str:
    return os.environ.get(NODE_ENV) or socket.gethostname()


# Wall clocks of one machine's processes that differ by no more than this agree (readers
# move the times of a process whose clock is further off onto the machine's clock).
CLOCKS_AGREE_SECONDS = 1.0


@functools.cache
def boot_id() -> str:
    """This boot of this machine ('' where unknown): the monotonic readings of two records
    may be compared only when they carry the same one."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read(64).strip()
    except OSError:
        return ""
