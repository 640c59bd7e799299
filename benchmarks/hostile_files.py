"""/metrics latency of a real agent with and without hostile files in the run directory.

    python benchmarks/hostile_files.py [--rounds 5] [--scrapes 100] [--json]

Two live "ranks" (this process's pid, status files rewritten every second like telemetry
does) and one agent process with its default config. Each round measures /metrics p99
over ``--scrapes`` requests without and then with the hostile files of
tests/rundir/test_rundir_hostile.py (a FIFO, a link to /dev/zero, a sparse 200 MB file, JSON
nested 100,000 deep, a rank claiming 10**30, wrong types, a rank mismatch, a socket, a
directory, a link out of the run directory), paired round by round; printed as the ratio
with its spread. Goal: with/without p99 <= 2 (the 200 MB file once made it 80x).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_rundir_hostile import hostile

from trainwatch.rundir.run_dir import RunDir


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _p99(url: str, n: int) -> float:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        with urllib.request.urlopen(url, timeout=10) as resp:
            resp.read()
        times.append(time.perf_counter() - started)
        time.sleep(0.02)
    return statistics.quantiles(times, n=100)[98]


def _clear(run: RunDir, names: list[str]) -> None:
    for name in names:
        path = run.status_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scrapes", type=int, default=100)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="tw-hostile-"))
    run = RunDir(folder / "run").create()
    stop = threading.Event()

    def beat() -> None:
        step = 0
        while not stop.is_set():
            now = time.time()
            for rank in (0, 1):
                run.write_status(rank, {"job": "bench", "rank": rank, "local_rank": rank,
                                        "pid": os.getpid(), "state": "running", "step": step,
                                        "heartbeat_at": now, "last_progress_at": now,
                                        "started_at": now - 60, "phase": "forward",
                                        "phase_since": now})
            step += 1
            stop.wait(1.0)

    threading.Thread(target=beat, daemon=True).start()
    port = _port()
    agent = subprocess.Popen([sys.executable, "-m", "trainwatch", "agent", "--run-dir",
                              str(run.root), "--listen", f"127.0.0.1:{port}"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                urllib.request.urlopen(url, timeout=2).read()
                break
            except OSError:
                time.sleep(0.3)
        time.sleep(3)
        rows = []
        for _ in range(args.rounds):
            without = _p99(url, args.scrapes)
            names = list(hostile(run, folder))
            time.sleep(2)  # let the collectors meet them
            with_files = _p99(url, args.scrapes)
            _clear(run, names)
            (folder / "outside.json").unlink(missing_ok=True)
            rows.append((without, with_files, with_files / without))
    finally:
        stop.set()
        agent.terminate()
        agent.wait(15)
        shutil.rmtree(folder, ignore_errors=True)
    ratios = [r[2] for r in rows]
    result = {"rounds": len(rows), "p99_without_ms": [round(r[0] * 1e3, 2) for r in rows],
              "p99_with_ms": [round(r[1] * 1e3, 2) for r in rows],
              "ratio_median": round(statistics.median(ratios), 3),
              "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3)}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"/metrics p99 with / without hostile files: median {result['ratio_median']} "
              f"(range {result['ratio_min']}-{result['ratio_max']}, {len(rows)} paired "
              f"rounds of {args.scrapes} scrapes); without {result['p99_without_ms']} ms, "
              f"with {result['p99_with_ms']} ms")


if __name__ == "__main__":
    main()
