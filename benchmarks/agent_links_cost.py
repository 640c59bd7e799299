"""The links collector's cost per run: CPU time of one ``collect()`` with 64 local ranks,
each holding real TCP connections (and other open files, as a rank holds CUDA and data
files), so the netlink dump and each rank's ``/proc/PID/fd`` listing are what they would
be on a 64-rank node.

    python benchmarks/agent_links_cost.py [--ranks 64] [--conns 64] [--files 200]
        [--runs 20] [--full-every SECONDS] [--json]

Each "rank" is a child process connected ``--conns`` times over loopback to a server
child, with ``--files`` extra fds open; the collector runs in this process on the ranks
collector's view of them (run ``exp``), ``--runs`` times; CPU is this thread's
``time.thread_time`` around each run (the ``ip``/``tc`` reads are children, and happen
every ``queues_every`` only). Loopback connections are within the node: the folding per
peer is measured on the same sockets by treating them as remote (``--remote``: the cost
of exporting every peer).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import textwrap
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from agent_helpers import collector, make_ctx, publish
from trainwatch.agent import link_view
from trainwatch.agent.registry import Result

RANK = textwrap.dedent("""
    import socket, sys, time
    conns = [socket.create_connection(("127.0.0.1", int(sys.argv[1])))
             for _ in range(int(sys.argv[2]))]
    files = [open("/dev/null") for _ in range(int(sys.argv[3]))]
    print("up", flush=True)
    while True:
        for c in conns:
            c.sendall(b"x")
        time.sleep(1)
""")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--conns", type=int, default=64)
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--remote", action="store_true")
    ap.add_argument("--full-every", type=float, default=None,
                    help="resolve every fd this often (0: every run; default: the collector's)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    server = socket.create_server(("127.0.0.1", 0), backlog=4096)
    port = server.getsockname()[1]
    held: list[socket.socket] = []
    procs = []
    try:
        for _ in range(args.ranks):
            p = subprocess.Popen([sys.executable, "-c", RANK, str(port), str(args.conns),
                                  str(args.files)], stdout=subprocess.PIPE, text=True)
            procs.append(p)
            for _ in range(args.conns):
                held.append(server.accept()[0])
            assert p.stdout is not None and p.stdout.readline().strip() == "up"
        ctx = make_ctx()
        publish(ctx, "ranks", Result(data={"jobs": [{"job": "exp", "run_dir": "/r", "ranks": [
            {"rank": i, "pid": p.pid, "node": "n0", "state": "running",
             "process": {"status": "sleeping"}} for i, p in enumerate(procs)]}]}))
        if args.remote:
            link_view.LOOPBACK = ()
            link_view.is_local = lambda dst, local: False  # type: ignore[assignment]
        links = collector(ctx, "links")
        if args.full_every is not None:
            links.fds.full_every = args.full_every
        links.collect()  # the first run reads the addresses and queues (children)
        cpu = []
        for _ in range(args.runs):
            t0 = time.thread_time()
            result = links.collect()
            cpu.append(time.thread_time() - t0)
        node = result.data["jobs"]["exp"]["nodes"]["n0"]
        out = {"ranks": args.ranks, "connections_per_rank": args.conns,
               "files_per_rank": args.files, "remote": args.remote,
               "rank_sockets": sum(s["connections"] for s in node["sockets"]),
               "series": len(result.every_sample()),
               "cpu_ms_median": round(1000 * statistics.median(cpu), 1),
               "cpu_ms_max": round(1000 * max(cpu), 1),
               "cpu_share_of_a_core_at_15s": round(statistics.median(cpu) / 15.0, 4),
               "load_average": os.getloadavg()}
        print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for s in held:
            s.close()
        server.close()


if __name__ == "__main__":
    main()
