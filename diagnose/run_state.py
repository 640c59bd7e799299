"""Per-rank status, recent step timings and launcher exits, from the run directory."""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path
from typing import Any

from trainwatch.diagnose.model import Evidence
from trainwatch.errors import FormatError
from trainwatch.rundir import RunDir, parse_json, read_run_file_tail

TAIL_BYTES = 64 * 1024
TAIL_STEPS = 50
# torchrun: "failed (exitcode: -9) local_rank: 1 (pid: 4242) of binary: ..."
_LAUNCHER_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")


def gather(run: RunDir, ev: Evidence) -> None:
    ev.run = run.run_info()
    statuses = run.statuses()
    ev.skipped += [str(s) for s in statuses.skipped]
    now = ev.collected_at
    for status in statuses.records:
        rank = status.get("rank")
        if not isinstance(rank, int):
            ev.skipped.append(f"{run.status_file(0).parent}: status without an integer rank")
            continue
        ev.ranks[rank] = rank_view(status, now)
        ev.ranks[rank]["recent"] = recent_steps(run.metrics_file(rank), run.root)
    if not ev.ranks:
        ev.cannot_see(f"no rank status files in {run.status_dir} (job not started, "
                      "or not using trainwatch telemetry)")
    expected = (ev.run or {}).get("world_size") or _world_size(ev.ranks)
    missing = sorted(set(range(expected or 0)) - set(ev.ranks))
    if missing:
        ev.cannot_see(f"no status file for rank(s) {missing}")
    ev.launcher = launcher_exits(run.logs_dir)


def rank_view(status: dict[str, Any], now: float) -> dict[str, Any]:
    """The status fields diagnose reasons about, with ages computed now."""
    def age(key: str) -> float | None:
        value = status.get(key)
        return round(now - value, 3) if isinstance(value, (int, float)) else None

    metrics = status.get("metrics") or {}
    return {
        "rank": status["rank"], "job": status.get("job"), "node": status.get("node"),
        "pid": status.get("pid"),
        "local_rank": status.get("local_rank"), "world_size": status.get("world_size"),
        "state": status.get("state"),
        "step": status.get("step"), "phase": status.get("phase"),
        "phase_since": status.get("phase_since"), "phase_age": age("phase_since"),
        "heartbeat_age": age("heartbeat_at"), "progress_age": age("last_progress_at"),
        "started_at": status.get("started_at"), "restart_count": status.get("restart_count"),
        "backend": status.get("backend"), "counters": status.get("counters") or {},
        "loss": metrics.get("loss"), "timing": status.get("timing"),
        "checkpoint": status.get("checkpoint"),
    }


def recent_steps(path: Path, root: Path | None = None) -> dict[str, Any]:
    """Medians over the last steps of a rank's metrics log (read from its tail only)."""
    try:
        tail = read_run_file_tail(path, root, max_bytes=TAIL_BYTES)
    except (OSError, FormatError):
        return {}
    # The first line of a cut tail is a fragment (parse_json skips it).
    steps = []
    for line in tail.splitlines():
        record, _ = parse_json(line)
        if isinstance(record, dict) and record.get("kind") == "step" and all(
                isinstance(record.get(k, 0), (int, float)) for k in (
                    "step_time_seconds", "data_wait_seconds")):
            steps.append(record)
    steps = steps[-TAIL_STEPS:]
    if not steps:
        return {}

    def median(key: str) -> float | None:
        values = [s[key] for s in steps if isinstance(s.get(key), (int, float))]
        return statistics.median(values) if values else None

    phases: dict[str, list[float]] = {}
    for s in steps:
        recorded = s.get("phase_seconds")
        for name, seconds in (recorded.items() if isinstance(recorded, dict) else ()):
            if isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
                phases.setdefault(str(name), []).append(seconds)
    losses = [s.get("loss") for s in steps if isinstance(s.get("loss"), (int, float))]
    return {"steps": len(steps), "last_step": steps[-1].get("step"),
            "step_time": median("step_time_seconds"), "data_wait": median("data_wait_seconds"),
            "phases": {k: statistics.median(v) for k, v in phases.items()},
            "nonfinite_losses": sum(1 for v in losses if not math.isfinite(v))}


def launcher_exits(logs_dir: Path) -> dict[str, Any]:
    """Worker exits torchrun logged ("failed (exitcode: -9) local_rank: 1 (pid: 42)")."""
    exits = []
    if logs_dir.is_dir():
        for path in sorted(logs_dir.glob("*.log")):
            try:
                tail = read_run_file_tail(path, logs_dir.parent, max_bytes=4 * TAIL_BYTES)
            except (OSError, FormatError):
                continue
            text = tail.decode("utf-8", "replace")
            for match in _LAUNCHER_FAILED.finditer(text):
                exits.append({"exitcode": int(match[1]), "local_rank": int(match[2]),
                              "pid": int(match[3]), "log": str(path)})
    return {"failed": exits}


def _world_size(ranks: dict[int, dict[str, Any]]) -> int:
    return max((r.get("world_size") or 0 for r in ranks.values()), default=0) or len(ranks)
