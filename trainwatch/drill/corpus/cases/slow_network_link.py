"""The network link of one node turns slow while the job runs: 2 nodes (network namespaces
joined by a veth pair, trainwatch/drill/corpus/launch.py), 1 rank each, and once the job
is past its fault step node 2's end of the link is rate-limited with a token bucket
(``tc qdisc add dev IF root tbf rate 256kbit``), as a link that negotiated down, a
congested uplink or a leftover traffic shaper does. Every rank's all_reduce crosses that
link: all ranks slow together, none is stuck or straggling in its own compute.

The kernels here have no ``netem`` (no fixed added delay); a rate limit adds the delay a
slow link has in practice: the time a collective's bytes wait in the egress queue.
"""

import json
import subprocess
from pathlib import Path

from trainwatch.drill.corpus.case import Case, Context, Expect
from trainwatch.drill.corpus.launch import NODES_FILE

RATE = "256kbit"   # ~32 KB/s: a step's 9 KB all_reduce waits ~0.3 s in the queue
SLOW_NODE = 1      # node 2 (index 1)


def mark(ctx: Context) -> None:
    """Detection counts from here; the runner slows the link when it sees this step."""


def _slow_node(work: Path) -> dict:
    return json.loads((work / NODES_FILE).read_text())[SLOW_NODE]


def slow_link(work: Path) -> None:
    node = _slow_node(work)
    done = subprocess.run(["ip", "netns", "exec", node["netns"], "tc", "qdisc", "add", "dev",
                           node["ifname"], "root", "tbf", "rate", RATE, "burst", "4kb",
                           "latency", "2s"], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"tc qdisc add on {node['netns']}: {done.stderr.strip()}")


def restore_link(work: Path) -> None:
    """Remove the qdisc if its namespace is still there (deleting the namespace, as the
    runner does, removes the veth and its qdisc with it)."""
    if (work / NODES_FILE).exists():
        node = _slow_node(work)
        subprocess.run(["ip", "netns", "exec", node["netns"], "tc", "qdisc", "del", "dev",
                        node["ifname"], "root"], capture_output=True)


CASE = Case(
    kind="slow_network_link",
    simulates="a slow network link: node 2's link is rate-limited to 256 kbit/s (a link "
              "that negotiated down, a congested uplink, a leftover shaper); every rank's "
              "collectives slow together",
    expect=Expect(category=("network",), ranks=(), cause=("slow network link",),
                  nodes=(SLOW_NODE,)),
    fault=mark, at_fault=slow_link, cleanup=restore_link, fault_step=40, nproc=1, nnodes=2,
    needs=("root", "network namespaces", "tc tbf"))
