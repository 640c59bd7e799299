"""The beat file: a rank's liveness that still gets through when its disk is full.

``status/rank-NNNNN.beat`` is one fixed-size record the rank allocates once at start and
then overwrites in place (``pwrite`` at offset 0, no new blocks, no rename, no temporary
file), so it keeps being written when the status file and the metrics log cannot be
(``ENOSPC`` on a full tmpfs or disk). It carries what a reader needs to tell "cannot
publish" from "frozen": the heartbeat, the step and when it last advanced, the phase, and
the rank's publish failures. A CRC in front of the JSON lets a reader drop a record it
caught mid-write.

Format (``BEAT_BYTES`` bytes): ``<crc32 of the JSON, 8 hex digits> <JSON>`` padded with
spaces to ``BEAT_BYTES - 1``, then ``\\n``.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

from trainwatch.contract.layout import rank_file_name
from trainwatch.errors import FormatError
from trainwatch.rundir import RunFolder, read_run_file

BEAT_BYTES = 1024
BEAT_SUFFIX = ".beat"
_ERROR_CHARS = 160


def beat_name(rank: int) -> str:
    return rank_file_name(rank, BEAT_SUFFIX)


def beat_path(status_dir: str | Path, rank: int) -> Path:
    return Path(status_dir) / beat_name(rank)


def encode(record: dict[str, Any]) -> bytes:
    """The fixed-size bytes of one record (a too-long error message is cut)."""
    record = dict(record)
    if isinstance(record.get("last_publish_error"), str):
        record["last_publish_error"] = record["last_publish_error"][:_ERROR_CHARS]
    body = json.dumps(record, separators=(",", ":"), default=str).encode()
    line = b"%08x " % zlib.crc32(body) + body
    if len(line) > BEAT_BYTES - 1:
        raise ValueError(f"beat record of {len(line)} bytes does not fit in {BEAT_BYTES}")
    return line.ljust(BEAT_BYTES - 1) + b"\n"


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
