"""Agent footprint: CPU, memory and /metrics latency with 8 (or more) simulated ranks;
straggler scoring time for 4096 ranks; a rank's status file size at 4k and 32k world size.

    python benchmarks/agent_footprint.py [--duration 30] [--ranks 8[,64,256]]
        [--step-seconds 0.1] [--config [FILE]] [--json]

`sleep` processes stand in for rank processes (so the agent inspects real pids); a
thread writes each one's status file and then its beat file every second, as trainer
telemetry does by default, with advancing steps (0.1 s each, or ``--step-seconds``) and a
timing window every 10 steps (its own means, its standing in its last windows and the
job summary, as the telemetry writes them).  The status size is measured on a real
``Telemetry`` fed one gathered window of 4,096 / 32,768 ranks.  The agent runs
as a separate process with its default config (or ``--config FILE``; ``--config`` alone
writes a file of the defaults' values, which the agent validates as any file); we sample its CPU time and RSS, and
first measure CPU and RSS in steady state (scraped every 15 s, like Prometheus, or every
``--scrape-interval``), then /metrics latency under a steady load of 5 requests per
second, each followed by a /healthz request as a side-by-side baseline (what the machine
and HTTP alone cost): once on the idle machine, once with a spinning process on every
core. Every scrape comes from a scraper process of its own (not this one, whose thread
writes the ranks' files).  With several ``--ranks`` counts it prints how CPU and RSS grow
per rank.  Goals: CPU <= 1 % of one core at 15 s scrapes, <= 2 % at 1 s scrapes and 64
ranks (issue #38); peak RSS <= 60 MiB (at 256 ranks too); /metrics p99 <= 20 ms; scoring
4096 ranks <= 10 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil

from trainwatch.agent.config import STRAGGLER_DEFAULTS
from trainwatch.agent.straggler import JobStragglers
from trainwatch.rundir.beat import BeatWriter, beat_path, own_window
from trainwatch.contract.timing import RECENT_WINDOWS, job_window, standing, summarize
from trainwatch.rundir.run_dir import RunDir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def simulate_ranks(run: RunDir, pids: list[int], stop: threading.Event, interval: float,
                   step_seconds: float = 0.1) -> None:
    world, started, step = len(pids), time.time(), 0
    rng = random.Random(0)
    timings: list[dict | None] = [None] * world
    recent: list[list[list]] = [[] for _ in range(world)]
    beats = [BeatWriter(beat_path(run.status_dir, rank)) for rank in range(world)]
    steps_per_write = max(1, round(interval / step_seconds))
    while not stop.wait(interval):
        now = time.time()
        window = step // 10 != (step + steps_per_write) // 10  # a 10-step window ended
        step += steps_per_write
        compute = [0.09 + rng.uniform(0, 0.005) for _ in range(world)]
        job = summarize(compute, half_width=world)  # widened to the local ranks, as theirs
        for rank, pid in enumerate(pids):
            if window:  # with the rank's standing in its last windows, as the telemetry's
                ratio, z = standing(job, compute[rank])
                recent[rank] = [*recent[rank][1 - RECENT_WINDOWS:],
                                [step - step % 10, round(ratio, 4), round(z, 3)]]
                timings[rank] = {"step": step - step % 10, "window_steps": 10, "time": now,
                                 "compute_seconds": compute[rank], "data_wait_seconds": 0.001,
                                 "local_seconds": compute[rank], "job": job,
                                 "recent": recent[rank]}
            run.write_status(rank, {
                "job": "bench", "rank": rank, "local_rank": rank, "world_size": world,
                "node": socket.gethostname(), "pid": pid, "restart_count": 0,
                "backend": "gloo", "device": "cpu", "started_at": started,
                "heartbeat_at": now, "step": step, "phase": "forward", "phase_since": now,
                "last_progress_at": now, "state": "running",
                "metrics": {"step": step, "loss": 2.0, "step_time_seconds": step_seconds,
                            "phase_seconds": {"data": 0.001, "forward": 0.03, "backward": 0.05,
                                              "optimizer": 0.01},
                            "data_wait_seconds": 0.001, "tokens_per_second": 1e5,
                            "samples_per_second": 100.0, "memory_bytes": 1 << 30},
                "counters": {"steps_total": step}, "timing": timings[rank]})
            beats[rank].write({  # right after the status, as the telemetry writes it
                "v": 1, "rank": rank, "pid": pid, "state": "running", "heartbeat_at": now,
                "step": step, "last_progress_at": now, "steps_total": step,
                "phase": "forward", "phase_since": now, "phase_budget": None,
                "timing_step": (timings[rank] or {}).get("step"),
                "window": own_window(timings[rank]),
                "step_time_seconds": step_seconds, "publish_errors_total": 0,
                "publish_failing_since": None, "last_publish_error": None})
    for writer in beats:
        writer.close()


def scoring_ms(n: int, reps: int = 50) -> float:
    rng = random.Random(1)
    times = []
    tracker = JobStragglers(dict(STRAGGLER_DEFAULTS))
    for i in range(reps):
        values = [0.1 * (1 + rng.gauss(0, 0.02)) for _ in range(n)]
        job = summarize(values)  # the ranks' side
        statuses = {r: {"step": 10 * (i + 1), "window_steps": 10, "time": float(i),
                        "local_seconds": values[r], "job": job} for r in range(8)}
        started = time.perf_counter()  # the agent's side: its 8 local ranks
        tracker.update(job_window(statuses), local_ranks=range(8), now=float(i))
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def status_bytes(world: int) -> int:
    """Size of a rank's status file after a timing window of ``world`` ranks."""
    from trainwatch.rank.telemetry import Telemetry
    from trainwatch.rank.timing_exchange import sketch_of
    rng = random.Random(2)
    with tempfile.TemporaryDirectory() as tmp:
        tel = Telemetry(tmp, rank=world - 1, world_size=world, exchange_every=0)
        tel.run.create()
        rows = [[0.09 + rng.uniform(0, 0.005), 0.001, 0.08 + rng.uniform(0, 0.005)]
                for _ in range(world)]
        tel._keep_window(10, 10, time.time(), rows[-1], sketch_of([r[2] for r in rows]))
        tel._write_status()
        return tel.run.status_file(world - 1).stat().st_size


GZIP = False  # scrapes ask for gzip (--gzip), as Prometheus' do

# The scraper runs as a process of its own: scraping from this one, whose thread writes
# the simulated ranks' files, had put that thread's work into the measured latencies.
SCRAPER = r"""
import gzip, json, sys, time, urllib.request
url, rate, seconds, packed_ok = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "1"
headers = {"Accept-Encoding": "gzip"} if packed_ok else {}
latencies, baseline, series = [], [], 0
t0 = next_at = time.monotonic()
while time.monotonic() - t0 < seconds:
    started = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as a:
        body, packed = a.read(), a.headers.get("Content-Encoding") == "gzip"
    latencies.append((time.perf_counter() - started) * 1000)
    body = gzip.decompress(body) if packed else body  # not timed: the client's work
    series = sum(1 for line in body.decode().splitlines() if not line.startswith("#"))
    started = time.perf_counter()  # baseline, side by side: a trivial endpoint
    urllib.request.urlopen(url.replace("/metrics", "/healthz"), timeout=5).read()
    baseline.append((time.perf_counter() - started) * 1000)
    next_at += 1.0 / rate
    time.sleep(max(0.0, next_at - time.monotonic()))
print(json.dumps({"latencies": latencies, "baseline": baseline, "series": series}))
"""


def measure(proc: psutil.Process, url: str, seconds: float, rate: float) -> dict:
    """Agent CPU seconds and peak RSS over ``seconds`` while a scraper process of its own
    scrapes at ``rate`` per second."""
    cpu0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
    scraper = subprocess.Popen([sys.executable, "-c", SCRAPER, url, str(rate), str(seconds),
                                "1" if GZIP else "0"], stdout=subprocess.PIPE, text=True)
    peak_rss = proc.memory_info().rss
    while scraper.poll() is None:
        peak_rss = max(peak_rss, proc.memory_info().rss)
        time.sleep(0.5)
    elapsed = time.monotonic() - t0
    cpu = sum(proc.cpu_times()[:2]) - cpu0
    found = json.loads(scraper.stdout.read() if scraper.stdout else "{}")
    return {"cpu": cpu, "elapsed": elapsed, "peak_rss": peak_rss, **found}


def busy_cores() -> list[subprocess.Popen]:
    """One spinning process per core: the latencies 'with every core busy'."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 1)]


SCRAPE_INTERVAL = 15.0  # seconds between scrapes in the steady window (Prometheus' default)


def node_exporter_usage(proc: psutil.Process, url: str, seconds: float) -> dict:
    """node_exporter's CPU and RSS over the same window as the agent's, scraped as often."""
    return measure(proc, url, seconds, 1 / SCRAPE_INTERVAL)


# ``--config`` without a file: the defaults' own values, written out (a file the agent
# must read and validate, so the agent runs as one started with a config file does)
DEFAULTS_CONFIG = """\
collectors:
  ranks: {interval: 1.0, status_every: 5.0}
stall: {floor_seconds: %s}
straggler: {ratio: %s}
"""


def defaults_config(folder: Path) -> Path:
    from trainwatch.agent.config import STRAGGLER_DEFAULTS
    from trainwatch.contract.stall import STALL_DEFAULTS
    path = folder / "agent.yaml"
    path.write_text(DEFAULTS_CONFIG % (STALL_DEFAULTS["floor_seconds"],
                                       STRAGGLER_DEFAULTS["ratio"]))
    return path


def footprint(ranks: int, duration: float, rate: float, compare: str | None = None,
              step_seconds: float = 0.1, config: str | None = None) -> dict:
    """One agent watching ``ranks`` simulated local ranks: steady state, then under load.
    With ``compare`` (node_exporter's path) it runs alongside, measured over the same
    steady-state window in a second thread."""
    tmp = Path(tempfile.mkdtemp(prefix="tw-footprint-"))
    run = RunDir(tmp / "run").create()
    sleepers = [subprocess.Popen(["sleep", str(duration * 2 + 120)]) for _ in range(ranks)]
    stop = threading.Event()
    writer = threading.Thread(target=simulate_ranks, args=(run, [p.pid for p in sleepers],
                                                           stop, 1.0, step_seconds),
                              daemon=True)
    writer.start()
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    agent = exporter = exporter_url = None
    if config == "":
        config = str(defaults_config(tmp))
    try:
        agent = subprocess.Popen([sys.executable, "-m", "trainwatch", "agent", "--run-dir",
                                  str(run.root), "--listen", f"127.0.0.1:{port}",
                                  *(["--config", config] if config else [])],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if compare:
            exporter_port = free_port()
            exporter = subprocess.Popen(
                [compare, f"--web.listen-address=127.0.0.1:{exporter_port}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            exporter_url = f"http://127.0.0.1:{exporter_port}/metrics"
        for _ in range(100):
            try:
                urllib.request.urlopen(url, timeout=2).read()
                break
            except OSError:
                time.sleep(0.2)
        time.sleep(3)  # let every collector run once (startup is not steady state)
        proc = psutil.Process(agent.pid)
        other: dict = {}
        side = None
        if exporter is not None:
            side = threading.Thread(target=lambda: other.update(node_exporter_usage(
                psutil.Process(exporter.pid), exporter_url, duration)), daemon=True)
            side.start()
        # 1. steady state: collectors at their default intervals, scraped every 15 s
        steady = measure(proc, url, duration, 1 / SCRAPE_INTERVAL)
        if side is not None:
            side.join(duration + 30)
        # 2. /metrics latency under a steady request load, on an idle machine and then
        # with a spinning process on every core
        loaded = measure(proc, url, max(20.0, duration / 3), rate)
        spinners = busy_cores()
        try:
            busy = measure(proc, url, max(20.0, duration / 3), rate)
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()
        hwm = next((int(line.split()[1]) * 1024 for line in
                    Path(f"/proc/{agent.pid}/status").read_text().splitlines()
                    if line.startswith("VmHWM:")), 0)
    finally:
        stop.set()
        for server in (agent, exporter):
            if server is not None:
                server.terminate()
                server.wait(15)
        for p in sleepers:
            p.kill()
            p.wait()
        writer.join(5)
        shutil.rmtree(tmp, ignore_errors=True)
    def q(f: float, values: list[float]) -> float:
        values = sorted(values)
        return values[min(len(values) - 1, int(f * len(values)))]
    return {
        "duration_s": round(steady["elapsed"], 1), "ranks": ranks, "agent_config": config,
        "scrapes": len(loaded["latencies"]), "series": loaded["series"],
        "cpu_fraction_of_one_core": steady["cpu"] / steady["elapsed"],
        "cpu_fraction_under_scrape_load": loaded["cpu"] / loaded["elapsed"],
        "peak_rss_mib": max(hwm, steady["peak_rss"], loaded["peak_rss"],
                            busy["peak_rss"]) / 2**20,
        "metrics_p50_ms": q(0.50, loaded["latencies"]),
        "metrics_p99_ms": q(0.99, loaded["latencies"]),
        "healthz_p50_ms": q(0.50, loaded["baseline"]),
        "healthz_p99_ms": q(0.99, loaded["baseline"]),
        "metrics_busy_p50_ms": q(0.50, busy["latencies"]),
        "metrics_busy_p99_ms": q(0.99, busy["latencies"]),
        "healthz_busy_p50_ms": q(0.50, busy["baseline"]),
        "healthz_busy_p99_ms": q(0.99, busy["baseline"]),
        "load_average_1m": os.getloadavg()[0],
        **({"node_exporter_cpu_fraction_of_one_core": other["cpu"] / other["elapsed"],
            "node_exporter_peak_rss_mib": other["peak_rss"] / 2**20,
            "agent_over_node_exporter_cpu": (steady["cpu"] / steady["elapsed"])
            / max(other["cpu"] / other["elapsed"], 1e-9),
            "agent_over_node_exporter_rss": steady["peak_rss"] / max(other["peak_rss"], 1)}
           if other else {}),
    }


def main() -> int:
    global SCRAPE_INTERVAL, GZIP
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=30.0,
                        help="seconds of steady state to measure (use 300 for a real figure)")
    parser.add_argument("--ranks", default="8",
                        help="simulated local ranks; a comma list runs one agent per count")
    parser.add_argument("--rate", type=float, default=5.0, help="/metrics requests per second")
    parser.add_argument("--node-exporter", nargs="?", const="/usr/bin/prometheus-node-exporter",
                        help="also run node_exporter (Debian's path by default) alongside and "
                             "compare CPU and memory")
    parser.add_argument("--scrape-interval", type=float, default=SCRAPE_INTERVAL,
                        help="seconds between scrapes in the steady-state window")
    parser.add_argument("--step-seconds", type=float, default=0.1,
                        help="the simulated ranks' step time (a timing window every 10 steps)")
    parser.add_argument("--gzip", action="store_true",
                        help="scrapes ask for gzip (Accept-Encoding), as Prometheus' do")
    parser.add_argument("--config", nargs="?", const="", metavar="FILE",
                        help="start the agent with --config FILE (alone: a file of the "
                             "defaults' values)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.node_exporter and not os.access(args.node_exporter, os.X_OK):
        parser.error(f"--node-exporter: {args.node_exporter} is not an executable "
                     "(Debian: apt-get install prometheus-node-exporter)")
    SCRAPE_INTERVAL, GZIP = args.scrape_interval, args.gzip
    counts = [int(c) for c in str(args.ranks).split(",") if c.strip()]
    runs = [footprint(n, args.duration, args.rate, args.node_exporter, args.step_seconds,
                      args.config) for n in counts]
    extra = {
        "straggler_scoring_4096_ms": scoring_ms(4096),
        "straggler_scoring_64_ms": scoring_ms(64),
        "status_bytes_world_4096": status_bytes(4096),
        "status_bytes_world_32768": status_bytes(32768),
        "cpus": os.cpu_count(),
    }
    goals = {"cpu_fraction_of_one_core": 0.02 if SCRAPE_INTERVAL <= 1 else 0.01,
             "peak_rss_mib": 60, "metrics_p99_ms": 20, "straggler_scoring_4096_ms": 10}
    if len(runs) > 1:  # how the footprint grows with the ranks, fewest to most
        first, last = runs[0], runs[-1]
        more = max(1, last["ranks"] - first["ranks"])
        extra["cpu_per_rank_percent"] = 100 * (last["cpu_fraction_of_one_core"]
                                               - first["cpu_fraction_of_one_core"]) / more
        extra["rss_per_rank_kib"] = (last["peak_rss_mib"] - first["peak_rss_mib"]) * 1024 / more
    if args.json:
        print(json.dumps({"runs": runs, "results": extra, "goals": goals}, indent=1))
        return 0
    for results in runs:
        print(f"agent footprint: {results['ranks']} simulated ranks"
              f"{' (with --config)' if args.config is not None else ''}; steady state "
              f"{results['duration_s']} s scraped every {SCRAPE_INTERVAL:g} s; then {results['scrapes']} scrapes "
              f"of {results['series']} series at {args.rate}/s (load average "
              f"{results['load_average_1m']:.1f})")
        print(f"{'measure':32} {'measured':>12} {'goal':>8}  ok")
        for key, value in results.items():
            if isinstance(value, float) and key != "load_average_1m":
                goal = goals.get(key)
                pct = "cpu_fraction" in key
                shown = f"{value * 100:.2f} %" if pct else f"{value:.2f}"
                goal_s = "" if goal is None else (f"{goal * 100:g} %" if pct else f"{goal:g}")
                if key.startswith("agent_over_node_exporter"):
                    goal, shown, goal_s = 1.0, f"{value:.2f}", "1"
                ok = "" if goal is None else ("yes" if value <= goal else "NO")
                print(f"{key:32} {shown:>12} {goal_s:>8}  {ok}")
    for key, value in extra.items():
        if key != "cpus":
            print(f"{key:32} {value:>12.4g}" if isinstance(value, float)
                  else f"{key:32} {value:>12}")
    print(f"(machine: {extra['cpus']} CPUs; latency and scoring times scale with the load)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
