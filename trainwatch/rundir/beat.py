"""The beat file: a rank's liveness that still gets through when its disk is full.

``status/rank-NNNNN.beat`` is one fixed-size record the rank allocates once at start and
then overwrites in place (``pwrite`` at offset 0, no new blocks, no rename, no temporary
file), so it keeps being written when the status file and the metrics log cannot be
(``ENOSPC`` on a full tmpfs or disk). It carries what a reader needs to tell "cannot
publish" from "frozen": the heartbeat, the step and when it last advanced, the phase, and
the rank's publish failures. A CRC in front of the JSON lets a reader drop a record it
caught mid-write.

It also carries the rank's own part of its newest timing window (``window``: its means
and its standing in its last windows), so an agent needs a rank's status for a new window
only for the job summary, which is the same on every rank (they all-reduce it): one
local rank's status gives it to all of them (``trainwatch/agent/rankfiles.py``). A
record that would not fit with its window goes without it (a long publish error); readers
then take the window from the status, as from a writer before ``window``.

And where the rank is in each process group's collectives (``collectives``:
trainwatch/contract/collectives.py), from which the agent names a stall's culprit.

Format (``BEAT_BYTES`` bytes): ``<crc32 of the JSON, 8 hex digits> <JSON>`` padded with
spaces to ``BEAT_BYTES - 1``, then ``\\n``.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

from trainwatch.contract.layout import BEAT_SUFFIX, rank_file_name
from trainwatch.contract.states import RANK_STATES
from trainwatch.contract.timing import own_local_seconds
from trainwatch.errors import FormatError
from trainwatch.rundir.safe_read import RunFolder, read_run_file

BEAT_BYTES = 1024
_ERROR_CHARS = 160
# The groups of ``collectives`` a record keeps before its window gives way.
_KEPT_GROUPS = 4
# What the beat keeps of a status ``timing`` besides its step (``timing_step``): what a
# straggler verdict reads of one rank (``trainwatch.contract.timing.job_window``).
_WINDOW_FIELDS = ("window_steps", "time", "local_seconds", "data_wait_seconds", "recent")


def beat_name(rank: int) -> str:
    return rank_file_name(rank, BEAT_SUFFIX)


def beat_path(status_dir: str | Path, rank: int) -> Path:
    return Path(status_dir) / beat_name(rank)


def _body(record: dict[str, Any]) -> bytes:
    return json.dumps(record, separators=(",", ":"), default=str).encode()


def encode(record: dict[str, Any]) -> bytes:
    """The fixed-size bytes of one record. What would not fit gives way, in this order: the
    least relevant groups of ``collectives`` (down to _KEPT_GROUPS: the writer puts first
    the groups the rank waits in, then the most recently active), the window (readers then
    take it from the status), the rest of ``collectives``, the tail of a long phase name
    (down to 64 characters), the publish error's tail, the rest of the phase name (a
    non-ASCII character is 6 bytes of JSON) — never the beat, which is the rank's liveness
    when nothing else gets through."""
    record = dict(record)
    if isinstance(record.get("last_publish_error"), str):
        record["last_publish_error"] = record["last_publish_error"][:_ERROR_CHARS]
    room = BEAT_BYTES - 10  # the CRC, its space and the newline take the rest
    body = _body(record)
    body = _fewer_groups(record, body, room, _KEPT_GROUPS)
    if len(body) > room and record.pop("window", None) is not None:
        body = _body(record)
    body = _fewer_groups(record, body, room, 0)
    for field, keep in (("phase", 64), ("last_publish_error", 0), ("phase", 1)):
        while len(body) > room and isinstance(record.get(field), str) \
                and len(record[field]) > keep:
            record[field] = record[field][:max(keep, len(record[field]) // 2)]
            body = _body(record)
    line = b"%08x " % zlib.crc32(body) + body
    if len(line) > BEAT_BYTES - 1:
        raise ValueError(f"beat record of {len(line)} bytes does not fit in {BEAT_BYTES}")
    return line.ljust(BEAT_BYTES - 1) + b"\n"


def _fewer_groups(record: dict[str, Any], body: bytes, room: int, keep: int) -> bytes:
    """The body with ``collectives``' last groups dropped until it fits or ``keep`` remain
    (none left: the field is null)."""
    groups = record.get("collectives")
    if len(body) <= room or not isinstance(groups, dict) or len(groups) <= keep:
        return body
    names = list(groups)
    while len(body) > room and len(names) > keep:
        names.pop()
        record["collectives"] = {n: groups[n] for n in names} or None
        body = _body(record)
    return body


def own_window(timing: Any) -> dict[str, Any] | None:
    """The beat's ``window`` from a status ``timing``: the rank's own part, with its local
    seconds as a reader takes them."""
    if not isinstance(timing, dict):
        return None
    window = {field: timing.get(field) for field in _WINDOW_FIELDS}
    window["local_seconds"] = own_local_seconds(timing)
    return window


def window_timing(beat: dict[str, Any], summary: Any) -> dict[str, Any] | None:
    """A status ``timing`` of the beat's newest window, its job summary taken from another
    rank's status of that window; None when the beat carries no usable window."""
    window = beat.get("window")
    step = beat.get("timing_step")
    if not isinstance(window, dict) or not isinstance(step, int) or isinstance(step, bool):
        return None
    return {**{field: window.get(field) for field in _WINDOW_FIELDS}, "step": step,
            "job": summary}


def decode(data: bytes) -> dict[str, Any] | None:
    """The record, or None for a torn, alien or corrupt one (the next beat will do)."""
    head, _, rest = data.partition(b" ")
    body = rest.rstrip(b" \n")
    try:
        if len(head) != 8 or int(head, 16) != zlib.crc32(body):
            return None
        record = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


class BeatWriter:
    """Owns one rank's beat file: allocated at open, overwritten in place after that."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, b" " * (BEAT_BYTES - 1) + b"\n", 0)  # allocate the blocks now
        except BaseException:
            os.close(self._fd)
            raise

    def write(self, record: dict[str, Any]) -> None:
        data = encode(record)
        if os.pwrite(self._fd, data, 0) != len(data):
            raise OSError("short write of the beat file")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_beat(path: str | Path, root: str | Path | None = None,
              folder: RunFolder | None = None) -> dict[str, Any] | None:
    """A rank's beat record (listed in ``folder`` when given), or None when there is none
    or it is unusable."""
    try:
        data = read_run_file(path, root, max_bytes=BEAT_BYTES) if folder is None else \
            folder.read(os.path.basename(path), max_bytes=BEAT_BYTES)
        return decode(data)
    except (OSError, FormatError):
        return None


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def declared_budgets(declared: Any) -> dict[str, float]:
    """Phase budgets a rank declared (Telemetry.declare_phase): positive numbers only."""
    if not isinstance(declared, dict):
        return {}
    return {str(k): float(v) for k, v in list(declared.items())[:64]
            if _num(v) is not None and 0 < v < 1e9}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# What ``merge_beat`` may replace of a status: its top-level fields, and in its "metrics"
# and "counters" (a reader may keep what it made of the rest while the status is the same).
MERGED_FIELDS = frozenset({"heartbeat_at", "heartbeat_mono", "last_progress_at", "phase_since",
                           "step", "steps_completed", "phase", "state", "phase_budgets",
                           "counters", "metrics"})
MERGED_METRICS = frozenset({"step", "step_time_seconds"})
MERGED_COUNTERS = frozenset({"steps_total"})


def merge_beat(s: dict[str, Any], beat: dict[str, Any] | None
               ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The status, brought up to date by the rank's beat file, and its publish state.

    The beat file is written in place right after the status file, so it is as new as
    the status when both work, and newer when the status cannot be written (full disk)
    or was read a few seconds ago (``RankFiles``): then its heartbeat, step and phase are
    the rank's truth. Only a beat of the same process counts (a stale one of an earlier
    start is ignored).
    """
    if beat is None or beat.get("pid") != s.get("pid") or beat.get("rank") != s["rank"]:
        return s, None
    failing_since = _num(beat.get("publish_failing_since"))
    errors = beat.get("publish_errors_total")
    publish = {"failing": failing_since is not None, "failing_since": failing_since,
               "errors_total": errors if isinstance(errors, int) else None,
               "last_error": str(beat.get("last_publish_error") or "")[:160] or None}
    heartbeat = _num(beat.get("heartbeat_at"))
    if heartbeat is None or heartbeat <= (_num(s.get("heartbeat_at")) or 0.0):
        return s, publish
    merged = dict(s, heartbeat_at=heartbeat)
    if _num(beat.get("heartbeat_mono")) is not None:
        merged["heartbeat_mono"] = beat["heartbeat_mono"]
    for field, ok in (("last_progress_at", _num), ("phase_since", _num),
                      ("step", _int), ("steps_completed", _int),
                      ("phase", lambda v: v if isinstance(v, str) else None),
                      ("state", lambda v: v if v in RANK_STATES else None)):
        value = ok(beat.get(field))
        if value is not None:
            merged[field] = value
    budget = _num(beat.get("phase_budget"))
    if budget is not None and isinstance(merged.get("phase"), str):
        merged["phase_budgets"] = {**declared_budgets(s.get("phase_budgets")), merged["phase"]: budget}
    steps = beat.get("steps_total")
    if isinstance(steps, int) and isinstance(s.get("counters"), dict):
        merged["counters"] = dict(s["counters"], steps_total=steps)
    # The step time too: the stall budget learns a rank's typical step from one per step seen.
    step_time = _num(beat.get("step_time_seconds"))
    if step_time is not None and step_time >= 0 and isinstance(s.get("metrics"), dict):
        merged["metrics"] = dict(s["metrics"], step=merged.get("step"),
                                 step_time_seconds=step_time)
    return merged, publish
