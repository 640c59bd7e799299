"""JSON-lines logs (the journal, the metrics logs): records read whole or skipped and
counted, torn lines resynchronised at the next record."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from trainwatch.contract.layout import (FORMAT_VERSION)
from trainwatch.rundir.safe_read import (MAX_LINE_BYTES, ReadResult, Skipped, SkippedFile, open_run_file,
                                        parse_json, short_value)

def parse_jsonl_line(line: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """One JSON-lines record, or why it is skipped; ``(None, None)`` for a blank line.

    The one definition of a torn or alien line, shared by ``read_jsonl`` and the agent's
    incremental journal reader.
    """
    if not line.strip():
        return None, None
    obj, why = parse_json(line)
    if why == "too_deep":
        return None, "nested too deeply"
    if why is not None:
        # A torn last line is what a crash mid-append leaves; say so plainly.
        return None, "torn or not JSON"
    if not isinstance(obj, dict):
        return None, "not a JSON object"
    version = obj.get("v", 1)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        return None, f"record version {short_value(version)} not supported"
    return obj, None


# Every JSON line trainwatch writes starts with its record version: where a torn fragment
# (a crash mid-append, an older writer on a full disk) has a whole line glued to it, the
# whole line starts at one of these.
RECORD_START = b'{"v":'


def parse_jsonl_pieces(line: bytes) -> list[tuple[dict[str, Any] | None, str | None]]:
    """``parse_jsonl_line`` of one line, resynchronised: a line that is not JSON but ends in
    a whole record glued to a torn fragment gives the fragment's skip reason, then the
    record (a torn line costs itself, never the next one)."""
    first = parse_jsonl_line(line)
    if first[1] != "torn or not JSON":
        return [first]
    at = line.find(RECORD_START, 1)
    while at > 0:
        obj, reason = parse_jsonl_line(line[at:])
        if reason != "torn or not JSON":
            return [first, (obj, reason)]
        at = line.find(RECORD_START, at + 1)
    return [first]


# json.loads(bytes) guesses the encoding, decodes and strips whitespace around the value
# before the C scanner runs; a line as trainwatch writes it ('{...}\n', UTF-8) goes to the
# scanner directly, several times cheaper per line for a reader of millions of lines.
_SCAN = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _plain_record(line: bytes) -> dict[str, Any] | None:
    """The record of a line in the writer's own form (an object from its first byte, a
    supported version), or None: then ``parse_jsonl_pieces`` decides, exactly as before
    (whatever this accepts, ``json.loads`` reads the same)."""
    try:
        text = line.decode()
        obj, end = _SCAN(text, 0)
    except Exception:  # not JSON, or not in the plain form: the full reader says why
        return None
    if type(obj) is not dict or (end != len(text) and text[end:] != "\n"):
        return None
    version = obj.get("v", 1)
    return obj if type(version) is int and version <= FORMAT_VERSION else None


def line_skip_code(reason: str) -> str:
    """The SKIP_REASONS code of a ``parse_jsonl_line`` reason."""
    return {"nested too deeply": "too_deep", "torn or not JSON": "not_json",
            "not a JSON object": "not_object"}.get(reason, "unsupported_version")


def iter_jsonl(path: str | Path, skipped: list[Skipped], root: str | Path | None = None, *,
               max_line_bytes: int = MAX_LINE_BYTES, tail_bytes: int | None = None
               ) -> Iterator[tuple[int, dict[str, Any]]]:
    """Stream a JSON-lines file as (line number, record), appending torn, alien or overlong
    lines to ``skipped``: memory stays one line, however long the file.

    ``tail_bytes``: only the whole lines of the file's last ``tail_bytes`` (a reader that
    needs the recent records of a log that may hold millions); line numbers then count
    from there."""
    try:
        fd, _ = open_run_file(path, root)
    except FileNotFoundError:
        return
    except SkippedFile as exc:
        skipped.append(Skipped(str(path), exc.detail, code=exc.reason))
        return
    with os.fdopen(fd, "rb") as fh:
        lineno, long_line = 0, False
        if tail_bytes is not None:
            try:
                size = os.fstat(fh.fileno()).st_size
                if size > tail_bytes:
                    fh.seek(size - tail_bytes - 1)
                    long_line = fh.read(1) != b"\n"  # mid-line: its rest is not a record
            except OSError as exc:
                skipped.append(Skipped(str(path), f"unreadable ({exc.strerror or exc})",
                                       code="unreadable"))
                return
        while True:
            try:
                line = fh.readline(max_line_bytes + 1)
            except OSError as exc:
                skipped.append(Skipped(str(path), f"unreadable ({exc.strerror or exc})",
                                       code="unreadable"))
                break
            if not line:
                break
            if long_line:  # the rest of a line already skipped
                long_line = not line.endswith(b"\n")
                continue
            lineno += 1
            if len(line) > max_line_bytes:
                long_line = not line.endswith(b"\n")
                skipped.append(Skipped(str(path), f"line longer than {max_line_bytes} "
                                       "bytes", lineno, code="too_large"))
                continue
            record = _plain_record(line)
            if record is not None:
                yield lineno, record
                continue
            for obj, reason in parse_jsonl_pieces(line):
                if reason is not None:
                    skipped.append(Skipped(str(path), reason, lineno,
                                           code=line_skip_code(reason)))
                elif obj is not None:
                    yield lineno, obj


def read_jsonl(path: str | Path, root: str | Path | None = None, *,
               max_line_bytes: int = MAX_LINE_BYTES) -> ReadResult:
    """Read a JSON-lines file, skipping (and reporting) torn, alien or overlong lines."""
    result = ReadResult()
    result.records = [obj for _, obj in iter_jsonl(path, result.skipped, root,
                                                   max_line_bytes=max_line_bytes)]
    return result
