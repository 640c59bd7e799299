"""The links collector: a rank's real TCP connections to another node (a network namespace
joined by a veth pair), folded per peer address, exported, published in /status; a link
slowed by a token bucket seen as slow with the queue that holds it back; and a rank the
agent may not inspect skipped and counted, never an error."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

from agent_helpers import collector, make_ctx, publish, samples, value, wait_for
from trainwatch.agent.exposition import ExpositionWriter
from trainwatch.contract.metrics import METRICS
from trainwatch.agent.registry import Result
from trainwatch.agent.status import build_status
from trainwatch.drill.netns import unavailable, veth_nodes
from trainwatch.host.socket_fds import SocketFds
from users_helpers import _ensure_user, _python_for_others

root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, users)")

# A "rank": 3 connections to the server on the other node, each sending 2 KB and reading
# the echo every 20 ms (a collective's traffic), until killed.
RANK = textwrap.dedent("""
    import socket, sys, time
    conns = [socket.create_connection((sys.argv[1], int(sys.argv[2]))) for _ in range(3)]
    print("connected", flush=True)
    while True:
        for c in conns:
            c.sendall(b"x" * 2048)
            got = 0
            while got < 2048:
                got += len(c.recv(65536))
        time.sleep(0.02)
""")
SERVER = textwrap.dedent("""
    import socket, threading
    srv = socket.create_server((\"0.0.0.0\", 29511))
    print("listening", flush=True)
    def echo(c):
        while (data := c.recv(65536)):
            c.sendall(data)
    while True:
        threading.Thread(target=echo, args=(srv.accept()[0],), daemon=True).start()
""")


def _ranks(pid: int, node: str = "n0") -> Result:
    """The ranks collector's view of one running rank (what the links collector reads)."""
    return Result(data={"jobs": [{"job": "exp", "run_dir": "/runs/exp", "ranks": [
        {"rank": 0, "pid": pid, "node": node, "state": "running",
         "process": {"status": "sleeping"}}]}]})


def _start(cmd: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip(), "did not start"
    return proc


@root
@pytest.mark.skipif(bool(unavailable()), reason=str(unavailable()))
def test_a_ranks_link_to_another_node_per_peer_and_slowed_by_a_token_bucket():
    with veth_nodes(2) as (n0, n1):
        _start(n1.cmd(sys.executable, "-c", SERVER))
        rank = _start(n0.cmd(sys.executable, "-c", RANK, n1.addr, "29511"))
        ctx = make_ctx()
        publish(ctx, "ranks", _ranks(rank.pid))
        links = collector(ctx, "links")
        lab = {"node": "node-a", "run": "exp", "peer": n1.addr}
        result = wait_for(lambda: (r := links.collect()) and samples(
            r, "trainwatch_link_rtt_seconds") and r, 10, what="an active link's RTT")
        # One peer, not one series per socket: 3 connections folded into one.
        assert set(samples(result, "trainwatch_link_rtt_seconds")) == {tuple(sorted(lab.items()))}
        assert value(result, "trainwatch_link_connections", **lab) == 3
        best = value(result, "trainwatch_link_min_rtt_seconds", **lab)
        assert 0 < best <= value(result, "trainwatch_link_rtt_seconds", **lab) < 0.005
        assert value(result, "trainwatch_link_retransmits_total", **lab) >= 0
        assert value(result, "trainwatch_link_unseen_processes", node="node-a", run="exp") == 0
        node = result.data["jobs"]["exp"]["nodes"]["n0"]
        assert node["ranks"] == [0] and node["addresses"][n0.addr] == n0.ifname
        [pair] = node["sockets"]
        assert (pair["src"], pair["dst"], pair["ranks"], pair["connections"]) == (
            n0.addr, n1.addr, [0], 3)
        rejected: list = []
        text = ExpositionWriter(METRICS, lambda *why: rejected.append(why)).render(
            result.every_sample()).decode()
        assert rejected == []
        assert "# TYPE trainwatch_link_retransmits_total counter" in text
        assert f'trainwatch_link_connections{{node="node-a",peer="{n1.addr}",run="exp"}} 3.0' \
            in text

        # The rank's end of the link rate-limited: its RTT climbs far above its best, and
        # the queue holding packets back is read at once (not after queues_every).
        subprocess.run(n0.cmd("tc", "qdisc", "add", "dev", n0.ifname, "root", "tbf", "rate",
                              "256kbit", "burst", "4kb", "latency", "2s"), check=True)
        slow = wait_for(lambda: (r := links.collect()) and value(
            r, "trainwatch_link_rtt_seconds", **lab) >= max(0.005, 5 * best) and r, 20,
            what="the shaped link's RTT 5x its best")
        qdisc = slow.data["jobs"]["exp"]["nodes"]["n0"]["qdiscs"][n0.ifname]
        assert qdisc["kind"] == "tbf" and qdisc["shaping"]
        # Served in /status for diagnose --agent: the other end of the link.
        publish(ctx, "links", slow)
        doc = build_status(ctx, listen="127.0.0.1:0", config_loaded_at=0.0)
        assert json.loads(json.dumps(doc))["links"]["jobs"]["exp"]["nodes"]["n0"]["sockets"]


@root
@pytest.mark.skipif(not shutil.which("setpriv"), reason="needs setpriv")
def test_a_rank_the_agent_may_not_inspect_is_skipped_and_counted(tmp_path):
    """An agent running as another user than the rank: its fds and namespace are not the
    agent's to read; the collector says so and exports the count, no traceback."""
    _ensure_user("twlinks")
    rank = _start([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"])
    try:
        python, path = _python_for_others()
        script = textwrap.dedent(f"""
            import json, sys
            sys.path[:0] = {path.split(os.pathsep)!r}
            sys.path.insert(0, {os.path.dirname(os.path.dirname(__file__))!r})
            from agent_helpers import collector, make_ctx, publish
            from trainwatch.agent.registry import Result
            ctx = make_ctx()
            publish(ctx, "ranks", Result(data=json.loads({json.dumps(_ranks(rank.pid).data)!r})))
            r = collector(ctx, "links").collect()
            print(json.dumps([r.state, r.data, [(s.name, s.value) for s in r.every_sample()]]))
        """)
        done = subprocess.run(["setpriv", "--reuid=twlinks", "--regid=twlinks",
                               "--clear-groups", python, "-c", script], capture_output=True,
                              text=True, cwd="/", timeout=60)
        assert done.returncode == 0, done.stderr
        state, data, exported = json.loads(done.stdout)
        assert state == "ok" and data["unseen_processes"] == {"exp": 1}
        assert "cannot be read" in data["unseen"][0]
        assert exported == [["trainwatch_link_unseen_processes", 1.0]]
    finally:
        rank.kill()
        rank.wait()


def test_a_processs_sockets_are_resolved_once_and_all_again_after_full_every():
    """Only fds not listed before are resolved each run; a closed fd's number reused by a
    new socket is seen at the next full read."""
    fds = SocketFds(full_every=3600.0)
    first = socket.socket()
    try:
        assert os.fstat(first.fileno()).st_ino in fds.inodes(os.getpid())
        number, old = first.fileno(), os.fstat(first.fileno()).st_ino
        first.close()
        again = socket.socket()
        try:
            assert again.fileno() == number  # the lowest free fd: the same number
            new = os.fstat(again.fileno()).st_ino
            assert old in fds.inodes(os.getpid())   # not resolved again yet
            fds.full_every = 0.0
            mine = fds.inodes(os.getpid())
            assert new in mine and old not in mine
        finally:
            again.close()
    finally:
        first.close()
    assert fds.inodes(2**22 + 1) is None  # no such process: unseen, not "no sockets"
