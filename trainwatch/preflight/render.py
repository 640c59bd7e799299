"""Preflight output: one table for people, one stable JSON document for machines.

The JSON keys are documented in docs/preflight.md; ``schema`` changes when they do.
"""

from __future__ import annotations

import json
import time
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from trainwatch.preflight.model import Check, counts

SCHEMA = "trainwatch.preflight/1"
_WIDTH = 400  # characters of one evidence line
_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "absent": "dim", "skipped": "dim"}


def report(checks: list[Check], *, node: str, strict: bool, exit_code: int) -> dict[str, Any]:
    return {"schema": SCHEMA, "node": node, "time": round(time.time(), 3), "strict": strict,
            "fit": exit_code == 0, "exit_code": exit_code, "counts": counts(checks),
            "checks": [c.as_dict() for c in checks]}


def to_json(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, sort_keys=False, default=str)


def render(data: dict[str, Any], console: Console) -> None:
    n = data["counts"]
    verdict = "FIT" if data["fit"] else "NOT FIT"
    summary = ", ".join(f"{n[s]} {s}" for s in ("fail", "warn", "ok", "absent", "skipped")
                        if n[s])
    console.print(Text(f"trainwatch preflight on {data['node']}: {verdict} ({summary}"
                       f"{'; --strict' if data['strict'] else ''})",
                       style="bold green" if data["fit"] else "bold red"))
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0))
    table.add_column("status", no_wrap=True)
    table.add_column("check", no_wrap=True)
    table.add_column("message", overflow="fold")
    for check in data["checks"]:
        table.add_row(Text(check["status"], style=_STYLE[check["status"]]), check["id"],
                      check["message"])
    console.print(table)
    for check in data["checks"]:
        if check["status"] in ("fail", "warn"):
            _details(check, console)


def _details(check: dict[str, Any], console: Console) -> None:
    console.print(Text(f"{check['status']}: {check['id']}", style=_STYLE[check["status"]]))
    for key, value in check["evidence"].items():
        if value in (None, [], {}, ""):
            continue
        if isinstance(value, (list, dict)):
            console.print(Text(f"  {key}:"))
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for name, item in items:
                prefix = "-" if isinstance(value, list) else f"{name}:"
                console.print(Text(f"    {prefix} {_compact(item)}"[:_WIDTH]), overflow="fold")
        else:
            console.print(Text(f"  {key}: {value}"[:_WIDTH]), overflow="fold")
    read = [f"trainwatch runbook {check['runbook']}"] if check["runbook"] else []
    console.print(Text(f"  read: {', '.join(read + [check['doc']])}", style="cyan"))


def _compact(value: Any) -> str:
    """A dict as 'k=v k=v' (short for people); anything else as itself or JSON."""
    if isinstance(value, dict):
        return " ".join(f"{k}={v if isinstance(v, str) else json.dumps(v, default=str)}"
                        for k, v in value.items() if v not in (None, "", [], {}))
    return value if isinstance(value, str) else json.dumps(value, default=str)
