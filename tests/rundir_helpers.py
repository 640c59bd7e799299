"""Hostile files in a run directory, shared by the reader's tests and the agent's."""

from __future__ import annotations

import json
import os
import socket

from trainwatch.rundir.run_dir import RunDir


def hostile(run: RunDir, tmp_path) -> dict[str, str]:
    """One bad file per kind; returns file name -> expected reason code."""
    s = run.status_dir
    os.mkfifo(s / "rank-00002.json")
    os.symlink("/dev/zero", s / "rank-00003.json")
    with open(s / "rank-00004.json", "wb") as fh:  # 200 MB, sparse: the size alone refuses it
        fh.truncate(200 << 20)
    (s / "rank-00005.json").write_text('{"format":"trainwatch.status","version":1,"x":'
                                       + "[" * 100_000 + "]" * 100_000 + "}")
    (s / "rank-00006.json").write_text(json.dumps(
        {"format": "trainwatch.status", "version": 1, "rank": 10 ** 30}))
    (s / "rank-00007.json").write_text(json.dumps(
        {"format": "trainwatch.status", "version": 1, "rank": 7, "heartbeat_at": "soon"}))
    (s / "rank-00008.json").write_text(json.dumps(
        {"format": "trainwatch.status", "version": 1, "rank": 1}))
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(s / "rank-00009.json"))
    sock.close()
    (s / "rank-00010.json").mkdir()
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"format": "trainwatch.status", "version": 1, "rank": 11}))
    os.symlink(outside, s / "rank-00011.json")
    return {"rank-00002.json": "special_file", "rank-00003.json": "outside_run_dir",
            "rank-00004.json": "too_large", "rank-00005.json": "too_deep",
            "rank-00006.json": "wrong_type", "rank-00007.json": "wrong_type",
            "rank-00008.json": "rank_mismatch", "rank-00009.json": "special_file",
            "rank-00010.json": "special_file", "rank-00011.json": "outside_run_dir"}
