"""Rank-side diagnostic dumps, written on request while the loop may be stuck.

Touching ``RUN_DIR/control/dump`` (what ``trainwatch diagnose`` does) makes every
rank's telemetry thread write ``diagnostics/dump-rank-NNNNN.json``: a Python stack
of every thread and the torch.distributed flight-recorder trace. The telemetry
thread keeps running while the main thread waits in a collective, so the dump
shows where each rank is *now*, long before any collective timeout; gloo writes
no dump on its own. The flight recorder is on only when ``TORCH_FR_BUFFER_SIZE``
is set (> 0) before the process group is created; otherwise the dump says so.

Format (``"format": "trainwatch.dump"``, version 1) is in docs/run-directory.md.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from trainwatch.contract.layout import CONTROL_DUMP, DUMP_FORMAT, FORMAT_VERSION
from trainwatch.rundir.atomic import atomic_write_json

MAX_FRAMES = 40
# Flight-recorder fields worth keeping (frames are trimmed; tensors never appear).
_FR_ENTRY_FIELDS = ("record_id", "pg_id", "process_group", "collective_seq_id", "p2p_seq_id",
                    "op_id", "profiling_name", "time_created_ns", "input_sizes",
                    "input_dtypes", "output_sizes", "output_dtypes", "state", "retired",
                    "is_p2p", "timeout_ms", "thread_name")


def install(on_control: Callable[[str, Callable[[Path], None]], None], *, rank: int,
            dump_file: Path, snapshot: Callable[[], dict[str, Any]],
            event: Callable[..., None]) -> None:
    """Answer ``control/dump`` requests from this rank's telemetry thread (``on_control``
    registers the handler; ``snapshot`` is a copy of the rank's status, ``event`` journals)."""
    def answer(request: Path) -> None:
        write_dump(request, rank=rank, dump_file=dump_file, snapshot=snapshot, event=event)

    on_control(CONTROL_DUMP, answer)


def write_dump(request: Path, *, rank: int, dump_file: Path,
               snapshot: Callable[[], dict[str, Any]], event: Callable[..., None]) -> Path:
    """Write this rank's stacks and flight-recorder trace; the request file's text is echoed."""
    try:
        request_id = request.read_text().strip()[:100]
    except OSError:
        request_id = ""
    state = snapshot()
    status = {k: state.get(k) for k in ("step", "phase", "phase_since", "state")}
    record: dict[str, Any] = {
        "format": DUMP_FORMAT, "version": FORMAT_VERSION, "rank": rank,
        "pid": os.getpid(), "request": request_id, "time": time.time(), **status,
        "threads": thread_stacks(), "flight_recorder": None, "flight_recorder_error": None,
    }
    record["flight_recorder"], record["flight_recorder_error"] = flight_recorder_trace()
    dump_file.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(dump_file, record, durable=False)
    event("diagnostics_dumped", request=request_id, path=str(dump_file))
    return dump_file


def thread_stacks() -> list[dict[str, Any]]:
    """Every Python thread's stack, innermost frame last (like a traceback)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    threads = []
    for ident, frame in sys._current_frames().items():
        frames = [{"file": f.filename, "line": f.lineno, "function": f.name}
                  for f in traceback.extract_stack(frame)][-MAX_FRAMES:]
        threads.append({"thread_id": ident, "name": names.get(ident, "?"),
                        "dumper": ident == me, "frames": frames})
    return threads


def flight_recorder_trace() -> tuple[dict[str, Any] | None, str | None]:
    """(trace, None) or (None, why not): disabled, unavailable, or failed."""
    if int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0) <= 0:
        return None, "flight recorder disabled (set TORCH_FR_BUFFER_SIZE, e.g. 2000)"
    try:
        # torch's stub for this extension module omits the flight recorder's dump.
        from torch._C._distributed_c10d import _dump_fr_trace  # type: ignore[attr-defined]
    except ImportError as exc:
        return None, f"flight recorder unavailable in this torch: {exc}"
    try:
        raw = pickle.loads(_dump_fr_trace(True, True, False))
    except Exception as exc:  # a dump must never fail the rank
        return None, f"flight recorder dump failed: {exc!r}"
    entries = []
    for entry in raw.get("entries", []):
        clean = {k: _plain(entry.get(k)) for k in _FR_ENTRY_FIELDS if k in entry}
        clean["frames"] = [{"file": f.get("filename"), "line": f.get("line"),
                            "function": f.get("name")} for f in entry.get("frames", [])[:8]]
        entries.append(clean)
    return {"version": raw.get("version"), "pg_config": _plain(raw.get("pg_config", {})),
            "pg_status": _plain(raw.get("pg_status", {})), "entries": entries}, None


def _plain(value: Any) -> Any:
    """Make the pickle's tuples and odd scalars JSON-friendly."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
