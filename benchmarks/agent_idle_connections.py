"""Agent /metrics and /healthz latency with 500 idle connections held open, against the
same agent idle, as ratios (goal: p99 within 2x of the idle baseline).

    python benchmarks/agent_idle_connections.py [--connections 500] [--rounds 5] [--requests 100]

One agent process (its default config, one run directory with two rank status files).
Each round measures, back to back, N requests to /metrics and to /healthz with no other
client (baseline), then the same with CONNECTIONS idle sockets open (half of them with a
half-sent request, as slow clients), then closes them. Prints each round's p50/p99 and
the ratio loaded/idle; the median and spread of the ratios over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from trainwatch.rundir.run_dir import RunDir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(url: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=10) as resp:
            resp.read()
        out.append(time.perf_counter() - t0)
    return out


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tw-bench-idle-"))
    run = RunDir(tmp / "exp1").create()
    for rank in (0, 1):
        run.write_status(rank, {"job": "exp1", "rank": rank, "local_rank": rank,
                                "world_size": 2, "pid": os.getpid(), "state": "running",
                                "step": 3, "heartbeat_at": time.time()})
    port = free_port()
    agent = subprocess.Popen([sys.executable, "-m", "trainwatch", "agent", "--listen",
                              f"127.0.0.1:{port}", "--run-dir", str(run.root)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    rows = []
    try:
        deadline = time.time() + 30
        while True:
            try:
                timed(base + "/healthz", 1)
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)
        time.sleep(3)  # collectors' first runs
        for _ in range(args.rounds):
            row = {}
            for path in ("/metrics", "/healthz"):
                row[f"idle{path}"] = timed(base + path, args.requests)
            socks = [socket.create_connection(("127.0.0.1", port)) for _ in
                     range(args.connections)]
            for s in socks[::2]:
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            time.sleep(0.5)
            for path in ("/metrics", "/healthz"):
                row[f"loaded{path}"] = timed(base + path, args.requests)
            for s in socks:
                s.close()
            time.sleep(0.5)
            rows.append({k: {"p50_ms": p(v, 0.5) * 1e3, "p99_ms": p(v, 0.99) * 1e3}
                         for k, v in row.items()})
    finally:
        agent.terminate()
        agent.wait(15)
    ratios = {path: [r[f"loaded{path}"]["p99_ms"] / r[f"idle{path}"]["p99_ms"] for r in rows]
              for path in ("/metrics", "/healthz")}
    summary = {path: {"p99_ratio_median": statistics.median(v), "min": min(v), "max": max(v)}
               for path, v in ratios.items()}
    if args.json:
        print(json.dumps({"rounds": rows, "summary": summary}, indent=1))
        return
    for i, r in enumerate(rows):
        print(f"round {i}: " + "  ".join(f"{k} p50 {v['p50_ms']:.1f} ms p99 {v['p99_ms']:.1f} ms"
                                         for k, v in r.items()))
    for path, s in summary.items():
        print(f"{path}: p99 with {args.connections} idle connections / idle = "
              f"{s['p99_ratio_median']:.2f} (median of {args.rounds}; {s['min']:.2f}-{s['max']:.2f})")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
