"""Ask every rank for a dump (control/dump) and collect the fresh answers.

Each rank's telemetry thread answers with diagnostics/dump-rank-NNNNN.json
(trainwatch/rank/dumps.py), echoing the request id, so a dump from an
earlier request is never mistaken for the present state.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from trainwatch.contract.layout import CONTROL_DIR, CONTROL_DUMP, DUMP_FORMAT
from trainwatch.diagnose.model import Evidence
from trainwatch.errors import FormatError
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.atomic import atomic_write_bytes
from trainwatch.rundir.safe_read import read_record

# Processes that cannot answer: waiting for them only wastes the budget.
_SILENT = ("gone", "zombie", "stopped")


def gather(run: RunDir, ev: Evidence, timeout: float) -> None:
    expected = [r for r, v in ev.ranks.items()
                if v.get("state") == "running"
                and (v.get("process") or {}).get("status") not in _SILENT]
    if not expected:
        return
    request_id = request(run)
    deadline = time.monotonic() + timeout
    pending = set(expected)
    while pending:
        for rank in sorted(pending):
            dump = read_dump(run, rank)
            if dump is not None and dump.get("request") == request_id:
                ev.dumps[rank] = dump
                pending.discard(rank)
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for rank in sorted(pending):
        ev.ranks[rank]["dump"] = f"no answer to {CONTROL_DIR}/{CONTROL_DUMP} within {timeout:g} s"
        ev.cannot_see(f"rank {rank}: no fresh dump (telemetry thread not answering)")
    for rank, dump in ev.dumps.items():
        if dump.get("flight_recorder_error"):
            ev.cannot_see(f"rank {rank}: {dump['flight_recorder_error']}")


def request(run: RunDir) -> str:
    """Touch control/dump with a fresh id; every rank's telemetry sees the new mtime."""
    request_id = uuid.uuid4().hex
    run.control_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(run.control_file(CONTROL_DUMP), request_id.encode(), durable=False)
    return request_id


def read_dump(run: RunDir, rank: int) -> dict[str, Any] | None:
    try:
        return read_record(run.dump_file(rank), DUMP_FORMAT, root=run.root)
    except FormatError:
        return None
