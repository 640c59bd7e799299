"""A stall at scale, simulated: 1,024 ranks over 128 nodes, one incident, one alert, diagnose.

    python benchmarks/scale_incident.py [--nodes 128] [--ranks-per-node 8] [--culprit 517]
           [--repeat 3] [--json]

A synthetic run directory holds one status file per rank (as trainer telemetry writes
them): every rank has stopped progressing 30 s ago; the culprit was SIGSTOPped in its
forward phase (stale heartbeat, process stopped), the others wait in the all-reduce
(fresh heartbeats).  Each of the 128 simulated nodes gets its own agent state — the
real ``findings`` collector (stall detection and incident grouping) fed with that node's
ranks as the ``ranks`` collector reports them — served as that agent's ``/metrics`` and
``/status`` (one local HTTP server, one path per node).  Then:

* the embedded alert engine scrapes all 128 ``/metrics`` and evaluates the shipped rules:
  TrainingStalled must fire exactly once, naming the culprit, with 1,023 waiting ranks;
* ``trainwatch diagnose --run-dir RUN --agent URL x 128 --json`` runs as a whole process
  (rank dump requests wait their full timeout: no simulated rank answers) and must name
  the culprit; its wall time is printed (goal: <= 20 s), with the engine's scrape+evaluate.
Every process and server it starts is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trainwatch.agent.exposition import TEXT  # noqa: E402

from trainwatch.agent.config import build_config  # noqa: E402
from trainwatch.agent.context import AgentContext  # noqa: E402
from trainwatch.agent.exporter import SnapshotExporter  # noqa: E402
from trainwatch.agent.registry import Result, all_collectors  # noqa: E402
from trainwatch.agent.state import CollectorRecord  # noqa: E402
from trainwatch.agent.status import build_status  # noqa: E402
from trainwatch.alerts.engine import Engine  # noqa: E402
from trainwatch.alerts.evaluate import History  # noqa: E402
from trainwatch.alerts.rules import load_rules  # noqa: E402
from trainwatch.alerts.scrape import Scraper  # noqa: E402
from trainwatch.rundir.run_dir import RunDir  # noqa: E402

RUN = "scale"
STALLED_FOR = 30.0


def rank_status(rank: int, node: str, local: int, world: int, culprit: int,
                now: float) -> dict[str, Any]:
    frozen = rank == culprit
    return {"rank": rank, "local_rank": local, "world_size": world, "node": node,
            "job": RUN, "pid": None, "state": "running", "step": 1200,
            "phase": "forward" if frozen else "backward",
            "phase_since": now - STALLED_FOR, "last_progress_at": now - STALLED_FOR,
            "heartbeat_at": now - (STALLED_FOR if frozen else 0.2),
            "heartbeat_interval": 1.0, "started_at": now - 3600, "restart_count": 0,
            "backend": "nccl", "device": f"cuda:{local}",
            "metrics": {"step": 1199, "step_time_seconds": 0.5}, "counters": {},
            "timing": None, "checkpoint": None}


class SimulatedNode:
    """One node's agent state: the real findings collector over that node's ranks."""

    def __init__(self, name: str, statuses: list[dict[str, Any]], culprit: int):
        self.ctx = AgentContext(build_config({}))
        self.ctx.config.node = name
        self.findings = all_collectors()["findings"].factory(
            self.ctx, self.ctx.config.collector("findings"))
        ranks = [{**s, "process": {"status": "stopped" if s["rank"] == culprit else "sleeping"}}
                 for s in statuses]
        self._publish("ranks", Result(data={"jobs": [{"job": RUN, "run_dir": "/sim",
                                                       "ranks": ranks, "timing": None,
                                                       "env": {}}]}))
        self.exporter = SnapshotExporter(self.ctx)

    def _publish(self, name: str, result: Result) -> None:
        self.ctx.store.set(CollectorRecord(name, True, 1, 1, state=result.state,
                                           data=result.data, samples=tuple(result.every_sample())))

    def collect(self) -> None:
        self._publish("findings", self.findings.collect())

    def metrics(self) -> bytes:
        return self.exporter.render(TEXT)

    def status(self) -> bytes:
        return json.dumps(build_status(self.ctx, listen="simulated",
                                       config_loaded_at=self.ctx.started_at)).encode()


def serve(nodes: dict[str, SimulatedNode]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # http.server's name
            parts = self.path.strip("/").split("/")
            node = nodes.get(parts[1]) if len(parts) == 3 and parts[0] == "node" else None
            if node is None or parts[2] not in ("metrics", "status"):
                self.send_error(404)
                return
            body = node.metrics() if parts[2] == "metrics" else node.status()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def build(tmp: Path, n_nodes: int, per_node: int, culprit: int):
    run = RunDir(tmp / RUN).create()
    world = n_nodes * per_node
    now = time.time()
    run.write_run_info({"job": RUN, "world_size": world})
    nodes = {}
    for n in range(n_nodes):
        name = f"sim-{n:03d}"
        statuses = [rank_status(n * per_node + i, name, i, world, culprit, now)
                    for i in range(per_node)]
        for s in statuses:
            run.write_status(s["rank"], s)  # what trainer telemetry writes
        nodes[name] = SimulatedNode(name, statuses, culprit)
    return run.root, nodes


def engine_alerts(base: str, nodes: dict[str, SimulatedNode]) -> tuple[list, float]:
    override = Path(tempfile.mkdtemp()) / "t.yaml"
    override.write_text("stall_for: 0s\n")
    history = History()
    engine = Engine(load_rules(thresholds_file=override), history)
    scraper = Scraper(history, [f"{base}/node/{name}/metrics" for name in nodes])
    started = time.perf_counter()
    now = time.time()
    scraper.scrape_all(now)
    engine.evaluate(now)
    took = time.perf_counter() - started
    return [a for a in engine.firing() if a.name == "TrainingStalled"], took


def diagnose(run: Path, base: str, nodes: dict[str, SimulatedNode]) -> tuple[dict, float]:
    cmd = [sys.executable, "-m", "trainwatch", "diagnose", "--run-dir", str(run), "--json"]
    for name in nodes:
        cmd += ["--agent", f"{base}/node/{name}"]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    took = time.perf_counter() - started
    if proc.returncode not in (0, 1):
        raise SystemExit(f"diagnose failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout), took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--culprit", type=int, default=517)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    world = args.nodes * args.ranks_per_node
    with tempfile.TemporaryDirectory() as tmp:
        run, nodes = build(Path(tmp), args.nodes, args.ranks_per_node, args.culprit)
        started = time.perf_counter()
        for node in nodes.values():
            node.collect()
        collect_s = time.perf_counter() - started
        server = serve(nodes)
        base = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            alerts, engine_s = engine_alerts(base, nodes)
            runs = [diagnose(run, base, nodes) for _ in range(args.repeat)]
        finally:
            server.shutdown()
            server.server_close()
    report, _ = runs[-1]
    top = report["findings"][0]
    times = [t for _, t in runs]
    result = {
        "ranks": world, "nodes": args.nodes, "culprit": args.culprit,
        "findings_collect_seconds_all_nodes": round(collect_s, 3),
        "alerts": [{"labels": a.labels, "value": a.value} for a in alerts],
        "one_alert_naming_culprit": len(alerts) == 1
        and alerts[0].labels.get("culprit_rank") == str(args.culprit)
        and alerts[0].value == world - 1,
        "engine_scrape_and_evaluate_seconds": round(engine_s, 3),
        "diagnose_seconds": [round(t, 2) for t in times],
        "diagnose_median_seconds": round(statistics.median(times), 2),
        "diagnose_top_finding": {k: top.get(k) for k in ("category", "title", "ranks",
                                                          "confidence")},
        "diagnose_names_culprit": top.get("ranks") == [args.culprit],
    }
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{world} ranks on {args.nodes} simulated nodes, culprit rank {args.culprit}")
        print(f"  findings collector, all nodes: {collect_s:.3f} s")
        print(f"  embedded engine (scrape {args.nodes} agents + evaluate): {engine_s:.3f} s; "
              f"TrainingStalled alerts: {len(alerts)} "
              f"{[(a.labels.get('culprit_rank'), a.value) for a in alerts]}")
        print(f"  diagnose over {args.nodes} agents: median {statistics.median(times):.2f} s, "
              f"max {max(times):.2f} s ({args.repeat} runs; goal <= 20 s); top finding: "
              f"{top.get('title')} ({top.get('confidence')})")
    if not (result["one_alert_naming_culprit"] and result["diagnose_names_culprit"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
