"""Per-rank status (brought up to date by its beat file), recent step timings and launcher
exits, from the run directory."""

from __future__ import annotations

import math
import os
import re
import stat
import statistics
from pathlib import Path
from typing import Any

from trainwatch.rundir.beat import beat_path, merge_beat, read_beat
from trainwatch.contract.layout import JOB_LOG_ATTEMPT_PREFIX
from trainwatch.contract.replicas import digests
from trainwatch.diagnose.model import Evidence
from trainwatch.errors import FormatError
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.safe_read import parse_json, read_run_file_tail
from trainwatch.rundir.torchrun_log import CLOSING_SIGNAL, FAILED_WORKER, MONITOR_INTERVAL

TAIL_BYTES = 64 * 1024
TAIL_STEPS = 50
MAX_MISMATCHES = 16  # a status keeps its newest few


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
        # The beat file is written in place after the status: newer when the status could
        # not be written (a full disk) or the rank died between the two.
        merged, publish = merge_beat(status, read_beat(beat_path(run.status_dir, rank),
                                                       run.root))
        ev.ranks[rank] = rank_view(merged, now)
        if merged is not status:
            ev.ranks[rank]["from_beat"] = {"status_step": status.get("step"),
                                           "status_heartbeat_at": status.get("heartbeat_at")}
        if publish and publish["failing"]:
            ev.ranks[rank]["publish"] = publish
        ev.ranks[rank]["recent"] = recent_steps(run.metrics_file(rank), run.root)
    ev.former_ranks = former_ranks(ev.ranks)
    for rank in ev.former_ranks:
        del ev.ranks[rank]
    if not ev.ranks:
        ev.cannot_see(f"no rank status files in {run.status_dir} (job not started, "
                      "or not using trainwatch telemetry)")
    expected = (ev.run or {}).get("world_size") or _world_size(ev.ranks)
    missing = sorted(set(range(expected or 0)) - set(ev.ranks))
    if missing:
        ev.cannot_see(f"no status file for rank(s) {missing}")
    ev.launcher = launcher_exits(run.logs_dir)


def former_ranks(ranks: dict[int, dict[str, Any]]) -> dict[int, int]:
    """{rank: the world size it ran at} of the statuses an earlier attempt left behind: the
    newest attempt (its newest-started rank says its world size W) was resumed at a smaller
    world size, and ranks W and up, whose statuses say another world size, are not in it.
    Neither live nor finished: not this job's ranks any more."""
    def started(view: dict[str, Any]) -> float:
        value = view.get("started_at")
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0

    if not ranks:
        return {}
    world = max(ranks.values(), key=started).get("world_size")
    if not isinstance(world, int) or isinstance(world, bool):
        return {}
    return {rank: view["world_size"] for rank, view in ranks.items() if rank >= world
            and isinstance(view.get("world_size"), int) and view["world_size"] != world}


def rank_view(status: dict[str, Any], now: float) -> dict[str, Any]:
    """The status fields diagnose reasons about, with ages computed now."""
    def age(key: str) -> float | None:
        value = status.get(key)
        return round(now - value, 3) if isinstance(value, (int, float)) else None

    metrics = status.get("metrics") or {}
    return {
        "rank": status["rank"], "job": status.get("job"), "node": status.get("node"),
        "pid": status.get("pid"), "cgroup": status.get("cgroup"),
        "local_rank": status.get("local_rank"), "world_size": status.get("world_size"),
        "state": status.get("state"),
        "step": status.get("step"), "steps_completed": status.get("steps_completed"),
        "phase": status.get("phase"),
        "phase_since": status.get("phase_since"), "phase_age": age("phase_since"),
        "heartbeat_age": age("heartbeat_at"), "progress_age": age("last_progress_at"),
        "heartbeat_at": status.get("heartbeat_at"),
        "heartbeat_interval": status.get("heartbeat_interval"),
        "started_at": status.get("started_at"),
        "process_created_at": status.get("process_created_at"),
        "boot": status.get("boot"),
        "restart_count": status.get("restart_count"),
        "backend": status.get("backend"), "counters": status.get("counters") or {},
        "loss": metrics.get("loss"), "timing": status.get("timing"),
        "checkpoint": status.get("checkpoint"),
        "failure": status.get("failure"),  # a failed rank's error, when it recorded one
        "replicas": digests(status.get("replicas")),  # its newest parameter digests
        "reduction_mismatches": _mismatches(status.get("reduction")),
    }


def _mismatches(reduction: Any) -> list[dict[str, Any]]:
    """The newest all-reduce checksum mismatches a rank recorded (well-formed ones)."""
    found = reduction.get("mismatches") if isinstance(reduction, dict) else None
    if not isinstance(found, list):
        return []
    return [m for m in found[-MAX_MISMATCHES:] if isinstance(m, dict)
            and isinstance(m.get("step"), int) and not isinstance(m.get("step"), bool)]


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
    losses = [loss for s in steps if isinstance(loss := s.get("loss"), (int, float))]
    return {"steps": len(steps), "last_step": steps[-1].get("step"),
            "step_time": median("step_time_seconds"), "data_wait": median("data_wait_seconds"),
            "phases": {k: statistics.median(v) for k, v in phases.items()},
            "nonfinite_losses": sum(1 for v in losses if not math.isfinite(v))}


def launcher_exits(logs_dir: Path) -> dict[str, Any]:
    """What torchrun logged about failed workers.

    ``failed``: its "failed (exitcode: -9) local_rank: 1 (pid: 42)" lines; ``root_cause``:
    the rank of its "Root Cause (first observed failure)" block with exit code, signal and
    error file (``TORCHELASTIC_ERROR_FILE`` contents when the worker wrote one) and
    ``attempt_errors``, each rank's first error line in the attempt that table ended;
    ``failures``: the other ranks of its "Failures:" block (those it tore down, and those
    that died on their own in the same poll); ``first_error``: the first error line of the
    newest attempt in the logs, with the rank its prefix names; ``errors_by_rank``: each
    rank's own first error line in it (by its ``[rankN]:`` prefix); ``torn_down``: the pids
    torchrun sent a closing signal (it stopped them: they had not exited on their own);
    ``monitor_interval``: how often torchrun polls its workers, when its log says (its launch
    configs, printed at INFO). An attempt begins at the supervisor's line before each start
    or at torchrun's restart of its worker group: errors of an attempt the run recovered
    from are not the cause of what happened after.
    """
    exits, root, others, first_error = [], None, [], None
    by_rank: dict[int, str] = {}
    torn_down: set[int] = set()
    interval = None
    if logs_dir.is_dir():
        for path in sorted(logs_dir.glob("*.log")):
            try:
                tail = read_run_file_tail(path, logs_dir.parent, max_bytes=4 * TAIL_BYTES)
            except (OSError, FormatError):
                continue
            text = tail.decode("utf-8", "replace")
            for match in FAILED_WORKER.finditer(text):
                exits.append({"exitcode": int(match[1]), "local_rank": int(match[2]),
                              "pid": int(match[3]), "log": str(path)})
            blocks = _failure_blocks(text, str(path))
            if blocks.get("root") and root is None:
                root = blocks["root"]
            others += blocks.get("failures", [])
            newest = _newest_attempt(text)
            if first_error is None:
                first_error = _first_error(newest, str(path))
            for rank, line in _errors_by_rank(newest).items():
                by_rank.setdefault(rank, line)
            torn_down |= {int(m[1]) for m in CLOSING_SIGNAL.finditer(text)}
            found = MONITOR_INTERVAL.findall(text)
            interval = float(found[-1]) if found else interval
    return {"failed": exits, "root_cause": root, "failures": others, "first_error": first_error,
            "errors_by_rank": by_rank, "torn_down": sorted(torn_down),
            "monitor_interval": interval}


# torchrun's failure table: "[1]:\n  time : ...\n  rank : 1 (local_rank: 1)\n  exitcode : -6
# (pid: 42)\n  error_file: <N/A>\n  traceback : ..." under "Failures:" / "Root Cause".
_ENTRY = re.compile(r"(?:time\s*:\s*(?P<time>\S+)\s*\n(?:\s*host\s*:[^\n]*\n)?\s*)?"
                    r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)"
                    r"\s*\(pid:\s*(\d+)\)[^\n]*\n\s*error_file\s*:\s*([^\n]*)")
_ERROR_LINE = re.compile(r"^(?:\[(?:rank|default)(\d+)\]:?\s*)?(?:terminate called|.*\b\w*Error\b:|"
                         r".*\bwhat\(\):)", re.M)


def _failure_blocks(text: str, log: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    root_at = text.rfind("Root Cause (first observed failure)")
    failures_at = text.rfind("Failures:", 0, root_at if root_at >= 0 else None)
    if root_at >= 0:
        match = _ENTRY.search(text, root_at)
        if match:
            out["root"] = _entry(match, log)
            # each rank's own first error in the attempt this table ended (an earlier one
            # than the newest when the run was started again)
            out["root"]["attempt_errors"] = _errors_by_rank(_newest_attempt(text[:root_at]))
    if 0 <= failures_at < root_at:
        out["failures"] = [_entry(m, log) for m in _ENTRY.finditer(text, failures_at, root_at)]
    return out


def _entry(match: re.Match, log: str) -> dict[str, Any]:
    error_file = match[6].strip()
    entry = {"rank": int(match[2]), "local_rank": int(match[3]), "exitcode": int(match[4]),
             "pid": int(match[5]), "log": log, "error_file": None, "error": None,
             "time": match["time"]}  # when torchrun observed it (a poll, to the second)
    if error_file and not error_file.startswith("<"):
        entry["error_file"] = error_file
        entry["error"] = _error_file_message(Path(error_file))
    return entry


def _error_file_message(path: Path) -> str | None:
    """The message a worker's @record wrote to TORCHELASTIC_ERROR_FILE (bounded read)."""
    try:  # regular files only: a FIFO named here must not hang diagnose
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            data, _ = parse_json(os.read(fd, TAIL_BYTES))
        finally:
            os.close(fd)
    except OSError:
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    return str(message)[:500] if message else None


_ATTEMPT_START = re.compile(rf"^{re.escape(JOB_LOG_ATTEMPT_PREFIX)}|"
                            r"attempts left; will restart worker group", re.M)


def _newest_attempt(text: str) -> str:
    """The part of a log after the last attempt began (all of it when none is marked)."""
    ends = [m.end() for m in _ATTEMPT_START.finditer(text)]
    if not ends:
        return text
    end = text.find("\n", ends[-1])  # the marker's own line says nothing of errors
    return text[end + 1:] if end >= 0 else ""


def _first_error(text: str, log: str) -> dict[str, Any] | None:
    match = _ERROR_LINE.search(text)
    if not match:
        return None
    line = text[match.start():text.find("\n", match.start())].strip()
    return {"rank": int(match[1]) if match[1] else None, "line": line[:300], "log": log}


def _errors_by_rank(text: str) -> dict[int, str]:
    found: dict[int, str] = {}
    for match in _ERROR_LINE.finditer(text):
        if match[1] is not None and int(match[1]) not in found:
            end = text.find("\n", match.start())
            found[int(match[1])] = text[match.start():end if end >= 0 else None].strip()[:300]
    return found


def _world_size(ranks: dict[int, dict[str, Any]]) -> int:
    return max((r.get("world_size") or 0 for r in ranks.values()), default=0) or len(ranks)
