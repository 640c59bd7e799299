"""Nodes suspected of silent data corruption: the record a replica rollback leaves for
``trainwatch preflight`` (docs/sdc.md). One file per node, ``FOLDER/<node>.json``, so the
rollback of a later run on the same node replaces it; preflight fails a node that a record
names until the file is removed (the node cleared after its GPUs were tested or replaced).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from trainwatch.contract.layout import FORMAT_VERSION, SUSPECT_FORMAT
from trainwatch.errors import FormatError
from trainwatch.rundir.atomic import atomic_write_json
from trainwatch.rundir.safe_read import read_run_file

MAX_RECORDS = 1000          # records read per folder: a full folder is not unbounded memory
MAX_RECORD_BYTES = 1 << 20


def suspect_file(folder: Path, node: str) -> Path:
    """``FOLDER/<node>.json``; characters a file name should not hold become ``_``."""
    return folder / ((re.sub(r"[^A-Za-z0-9._-]", "_", node).lstrip(".") or "_") + ".json")


def write_suspect(folder: Path, node: str, fields: dict[str, Any]) -> Path:
    """Write (or replace) the record naming ``node``; ``fields``: ranks, run, time, evidence."""
    folder.mkdir(parents=True, exist_ok=True)
    path = suspect_file(folder, node)
    atomic_write_json(path, {"format": SUSPECT_FORMAT, "version": FORMAT_VERSION,
                             "node": node, **fields})
    return path


def suspects_of(folder: Path, node: str) -> tuple[list[tuple[Path, dict[str, Any]]], list[str]]:
    """The records in ``folder`` that name ``node``, and the files that could not be read
    as records (each with why). Matched on the record's ``node``, not the file name."""
    found: list[tuple[Path, dict[str, Any]]] = []
    bad: list[str] = []
    try:
        paths = sorted(folder.glob("*.json"))[:MAX_RECORDS]
    except OSError as exc:
        return found, [f"{folder}: {exc.strerror or exc}"]
    for path in paths:
        try:
            record = json.loads(read_run_file(path, max_bytes=MAX_RECORD_BYTES))
        except FileNotFoundError:  # cleared while we looked
            continue
        except (OSError, FormatError, ValueError, RecursionError) as exc:
            bad.append(f"{path}: {exc}")
            continue
        if not isinstance(record, dict) or record.get("format") != SUSPECT_FORMAT:
            bad.append(f"{path}: not a {SUSPECT_FORMAT} record")
        elif record.get("node") == node:
            found.append((path, record))
    return found, bad
