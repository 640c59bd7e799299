"""A slow network link between nodes: the kernel's per-socket TCP view (netlink INET_DIAG,
parsed from packed messages and read for real from a loopback connection), the
interfaces' egress queues (iproute2's JSON), and the rule that names the slow link and
its slowed node, not a rank that "straggles" or is "stuck"."""

import json
import os
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agent_helpers import make_ctx, publish
from trainwatch.agent.link_view import address_pairs
from trainwatch.agent.registry import Result
from trainwatch.agent.status import build_status
from trainwatch.diagnose import agent_links, agents, analysis
from trainwatch.diagnose.model import Evidence
from trainwatch.host.link_queues import parse_addresses, parse_qdiscs
from trainwatch.host.tcp_diag import (INET_DIAG_INFO, NLMSG_DONE, NLMSG_ERROR,
                                      SOCK_DIAG_BY_FAMILY, parse_dump, socket_inodes,
                                      tcp_sockets)
from trainwatch.rundir.run_dir import RunDir


def _nlmsg(kind: int, body: bytes) -> bytes:
    msg = struct.pack("=IHHII", 16 + len(body), kind, 0, 1, 0) + body
    return msg + b"\0" * (-len(msg) % 4)


def _diag_msg(src: str, sport: int, dst: str, dport: int, inode: int, info: bytes) -> bytes:
    head = struct.pack("=BBBB2H16s16sI8sIIIII", socket.AF_INET, 1, 0, 0, socket.htons(sport),
                       socket.htons(dport), socket.inet_aton(src) + bytes(12),
                       socket.inet_aton(dst) + bytes(12), 0, bytes(8), 0, 0, 0, 0, inode)
    return head + struct.pack("=HH", 4 + len(info), INET_DIAG_INFO) + info


def _tcp_info(rtt_us: int, min_rtt_us: int, retrans: int) -> bytes:
    info = bytearray(232)
    struct.pack_into("=I", info, 44, 12)           # last_data_sent, ms ago
    struct.pack_into("=II", info, 68, rtt_us, 900)  # rtt, rttvar
    struct.pack_into("=I", info, 100, retrans)     # total_retrans
    struct.pack_into("=Q", info, 120, 9000)        # bytes_acked
    struct.pack_into("=I", info, 148, min_rtt_us)  # min_rtt
    return bytes(info)


def test_a_netlink_dump_is_parsed_into_each_sockets_rtt_best_and_retransmissions():
    data = _nlmsg(SOCK_DIAG_BY_FAMILY, _diag_msg("10.77.0.2", 41000, "10.77.0.1", 29500, 777,
                                                 _tcp_info(106_400, 1, 6)))
    sockets, done = parse_dump(data + _nlmsg(NLMSG_DONE, struct.pack("=i", 0)))
    assert done and len(sockets) == 1
    s = sockets[0]
    assert (s["src"], s["sport"], s["dst"], s["dport"], s["inode"]) == (
        "10.77.0.2", 41000, "10.77.0.1", 29500, 777)
    assert (s["rtt_ms"], s["rttvar_ms"], s["min_rtt_ms"]) == (106.4, 0.9, 0.001)
    assert (s["total_retrans"], s["last_data_sent"], s["bytes_acked"]) == (6, 12, 9000)
    with pytest.raises(OSError, match="sock_diag: Operation not permitted"):
        parse_dump(_nlmsg(NLMSG_ERROR, struct.pack("=i", -1) + bytes(16)))


def test_the_kernel_reports_a_live_connections_rtt_by_the_sockets_this_process_holds():
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    try:
        for _ in range(5):
            client.sendall(b"x" * 1000)
            peer.recv(4096)
        mine = socket_inodes(os.getpid())
        found = [s for s in tcp_sockets() if s["inode"] in mine
                 and s["dport"] == server.getsockname()[1]]
        assert len(found) == 1, found
        assert found[0]["src"] == "127.0.0.1" and found[0]["rtt_ms"] >= found[0]["min_rtt_ms"]
        assert found[0]["bytes_acked"] >= 5000
    finally:
        for s in (client, peer, server):
            s.close()


TC_JSON = ('[{"kind":"noqueue","handle":"0:","dev":"lo","root":true,"options":{},'
           '"packets":0,"overlimits":0,"drops":0,"backlog":0},'
           '{"kind":"tbf","handle":"8006:","dev":"twv1","root":true,"options":{"rate":32000,'
           '"burst":4096,"lat":2000000},"bytes":838384,"packets":1058,"drops":0,'
           '"overlimits":331,"requeues":0,"backlog":7570,"qlen":6}]')
IP_JSON = ('[{"ifindex":1,"ifname":"lo","addr_info":[{"family":"inet","local":"127.0.0.1"}]},'
           '{"ifindex":5,"ifname":"twv1","addr_info":[{"family":"inet","local":"10.77.0.2"}]}]')


def test_egress_queues_and_addresses_from_iproute2s_json():
    q = parse_qdiscs(TC_JSON)
    assert q["twv1"] == {"kind": "tbf", "shaping": True, "rate": 32000, "delay": None,
                         "packets": 1058, "overlimits": 331, "drops": 0, "backlog": 7570}
    assert q["lo"]["shaping"] is False
    assert parse_addresses(IP_JSON) == {"127.0.0.1": "lo", "10.77.0.2": "twv1"}


def _conn(rank, src, dst, rtt, best=0.001, retrans=0):
    return {"rank": rank, "src": src, "sport": 40000 + rank, "dst": dst, "dport": 29500,
            "rtt_ms": rtt, "min_rtt_ms": best, "rttvar_ms": 1.0, "total_retrans": retrans,
            "last_data_sent": 5, "last_data_recv": 5, "bytes_acked": 9000}


def _node(index, sockets, shaped=False):
    dev = f"twv{index}"
    qdisc = ({"kind": "tbf", "shaping": True, "rate": 32000, "delay": None, "packets": 1058,
              "overlimits": 331, "drops": 0, "backlog": 7570} if shaped else
             {"kind": "noqueue", "shaping": False, "rate": None, "delay": None, "packets": 0,
              "overlimits": 0, "drops": 0, "backlog": 0})
    return {"netns": f"net:[{index}]", "ranks": sorted({s["rank"] for s in sockets}),
            "addresses": {"127.0.0.1": "lo", f"10.77.0.{index + 1}": dev},
            "qdiscs": {dev: qdisc}, "sockets": sockets}


def evidence(rtt, *, shaped=(1,), slowed=6.1, nodes=2, best=0.001):
    """Ranks 0 (node n0, 10.77.0.1) and 1 (node n1, 10.77.0.2), each connected to the
    other over the veth (and, with 3 nodes, rank 2 on n2 connected fast to n0)."""
    ev = Evidence(run_dir="/r", collected_at=time.time(), host="h")
    for rank in range(nodes):
        ev.ranks[rank] = {"rank": rank, "node": f"n{rank}", "pid": 100 + rank,
                          "state": "running", "step": 60, "phase": "allreduce",
                          "heartbeat_age": 0.1, "progress_age": 0.3, "phase_age": 0.3,
                          "recent": {"step_time": 0.6}, "process": {"status": "sleeping"}}
    n0 = [_conn(0, "10.77.0.1", "10.77.0.2", rtt, best, 6)]
    n1 = [_conn(1, "10.77.0.2", "10.77.0.1", rtt, best, 0)]
    made = {"n0": _node(0, n0, 0 in shaped), "n1": _node(1, n1, 1 in shaped)}
    if nodes == 3:
        n0.append(_conn(0, "10.77.0.1", "10.77.0.3", 0.05))
        made["n2"] = _node(2, [_conn(2, "10.77.0.3", "10.77.0.1", 0.05),
                               _conn(2, "10.77.0.3", "10.77.0.2", rtt, best)], 2 in shaped)
        made["n1"]["sockets"].append(_conn(1, "10.77.0.2", "10.77.0.3", rtt, best))
    ev.node_network = {"nodes": made, "slowdown": {
        r: {"recent": 0.05 * slowed, "baseline": 0.05, "ratio": slowed} for r in range(nodes)}}
    return ev


def test_a_slow_link_names_the_shaped_node_not_a_straggler_or_a_stuck_rank():
    """The corpus's slow_network_link as diagnose saw it (2026-12-06): node n1's egress
    rate-limited, every rank 6x slower, the link's RTT 106 ms against 1 us at its best."""
    found = analysis.analyse(evidence(106.4))
    top = found[0]
    assert (top.category, top.ranks, top.nodes) == ("network", [], ["n1"])
    assert top.title == "slow network link: node n1 ↔ node n0, RTT 106.4 ms (0.001 ms at its best)"
    assert top.evidence[0] == ("2 TCP connection(s) of rank(s) [0, 1] between n1 and n0: RTT "
                               "106.4 ms now (median), 0.001 ms at their best (the kernel's "
                               "min_rtt), 6 retransmission(s)")
    assert "node n1: the egress queue of twv1 shapes its traffic (tbf rate 256 kbit/s): 331 " \
           "packet(s) held back (overlimits), 0 dropped, 7570 B queued" in top.evidence
    assert not [f for f in found if f.category in ("straggler", "rank_stuck")], found


def test_with_three_nodes_the_node_on_every_slow_link_is_named_and_others_compared():
    top = analysis.analyse(evidence(80.0, shaped=(), nodes=3))[0]
    assert top.category == "network" and top.nodes == ["n1"], top
    assert top.title.startswith("slow network link: node n1 ↔ node n") and \
        top.title.endswith("RTT 80.0 ms (others 0.05 ms)")
    assert "the job's fastest other link: RTT 0.050 ms (median of its connections)" in \
        top.evidence


def test_a_slow_link_neither_end_shapes_names_both_ends():
    top = analysis.analyse(evidence(60.0, shaped=()))[0]
    assert top.category == "network" and top.nodes == ["n0", "n1"]
    assert any("neither end's egress queue shapes this link" in e for e in top.evidence)


def test_a_fast_link_a_link_always_this_slow_or_a_job_that_kept_its_pace_is_no_finding():
    for ev in (evidence(0.08),                 # a healthy veth: tens of microseconds
               evidence(40.0, best=30.0),      # as slow as it ever was: a long link
               evidence(106.4, slowed=1.05)):  # a slow link the job does not wait on
        assert not any(f.category == "network" for f in analysis.analyse(ev))


@pytest.fixture
def served():
    """Serves JSON documents at /<name>/status over real HTTP; yields the dict to fill."""
    docs: dict[str, bytes] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = docs.get(self.path.split("/")[1])
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield docs, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_slow_link_between_two_nodes_diagnose_sees_only_through_their_agents(
        tmp_path, served):
    """diagnose on a host running no rank (a login node): each node's agent publishes its
    ranks' links per address pair in /status (the links collector's shape, built by
    agent/link_view.py from per-socket views), and the rule names the shaped node."""
    docs, base = served
    made = evidence(106.4).node_network["nodes"]
    for name, node in made.items():
        ctx = make_ctx()
        ctx.config.node = name
        owned = [(s["rank"], {**s, "inode": i}) for i, s in enumerate(node["sockets"] * 2)]
        publish(ctx, "links", Result(data={"jobs": {"exp": {"nodes": {name: {
            **{k: node[k] for k in ("netns", "ranks", "addresses", "qdiscs")},
            "sockets": address_pairs(owned)}}}}, "unseen_processes": {"exp": 0}}))
        docs[name] = json.dumps(build_status(ctx, listen="", config_loaded_at=0.0)).encode()
    ev = evidence(106.4)
    ev.node_network = {}                          # this host sees no rank's connections
    for view in ev.ranks.values():
        view["job"] = "exp"
    agents.gather(ev, [f"{base}/n0", f"{base}/n1"], timeout=5.0)
    agent_links.gather(RunDir(tmp_path), ev)
    assert ev.node_network["nodes"]["n1"]["via"] == "agent n1"
    top = analysis.analyse(ev)[0]
    assert (top.category, top.ranks, top.nodes) == ("network", [], ["n1"])
    assert top.evidence[0].startswith("4 TCP connection(s) of rank(s) [0, 1] between n1 "
                                      "and n0: RTT 106.4 ms now (median)")
