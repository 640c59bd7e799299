"""The JSON-lines reader's fast path for lines in the writer's own form reads exactly what
the full parse reads, and leaves every other line to it (issue #25: report time)."""

from __future__ import annotations

import json
from pathlib import Path

from trainwatch.rundir.jsonl import iter_jsonl, line_skip_code, parse_jsonl_pieces

LINES = [
    b'{"v":1,"kind":"step","step":3,"time":1.5}\n',
    b'{"v":1,"kind":"step","step":4,"time":1.6}',           # last line, no newline
    b'  {"v":1,"step":5}\n',                                # leading whitespace
    b'{"v":1,"step":6}  \r\n',                              # trailing whitespace
    b'{"v":1,"step":7}\x0c\n',                              # not JSON whitespace
    b'\xef\xbb\xbf{"v":1,"step":8}\n',                      # UTF-8 byte order mark
    '{"v":1,"step":9}\n'.encode("utf-16"),                  # another encoding
    b'{"v":2,"step":10}\n',                                 # newer record version
    b'{"v":true,"step":11}\n',
    b'{"v":"1","step":12}\n',
    b'{"step":13}\n',                                       # no version: 1
    b'[1,2]\n', b'"text"\n', b'\n', b'   \n',
    b'{"v":1,"step":14,"x":NaN}\n',
    b'{"v":1,"st' + b'{"v":1,"step":15}\n',                 # torn fragment, whole record
    b'{"v":1,"step":16}{"v":1}\n',                          # extra data
    b'{"v":1,"s":"\xff"}\n',                                # not UTF-8
    b'{"v":1,"deep":' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
]


def test_every_line_read_as_the_full_parse_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    path.write_bytes(b"".join(line if line.endswith(b"\n") else line + b"\n"
                              for line in LINES))
    expected, expected_skips = [], []
    for lineno, line in enumerate(path.read_bytes().splitlines(keepends=True), 1):
        for obj, reason in parse_jsonl_pieces(line):
            if reason is not None:
                expected_skips.append((lineno, line_skip_code(reason)))
            elif obj is not None:
                expected.append((lineno, json.dumps(obj)))
    skipped: list = []
    got = [(n, json.dumps(obj)) for n, obj in iter_jsonl(path, skipped)]
    assert got == expected
    assert [(s.line, s.code) for s in skipped] == expected_skips
    assert len(got) >= 8 and len(skipped) >= 8  # both paths exercised


def test_a_tail_read_starts_at_the_first_whole_line_within_it(tmp_path):
    """``tail_bytes``: the recent records of a long log, never a line's torn rest."""
    path = tmp_path / "log.jsonl"
    lines = [json.dumps({"v": 1, "step": i}).encode() + b"\n" for i in range(100)]
    path.write_bytes(b"".join(lines))
    whole = len(lines[-1]) * 3
    for tail, first in ((whole, 97), (whole + 1, 97), (whole + len(lines[-4]), 96),
                        (whole - 1, 98), (10 ** 9, 0)):
        skipped: list = []
        steps = [r["step"] for _, r in iter_jsonl(path, skipped, tail_bytes=tail)]
        assert steps == list(range(first, 100)) and skipped == [], (tail, steps[:3], skipped)
