"""Per-process-group collective sequences from the ranks' flight-recorder dumps.

Works on gloo dumps (which the stock analyzer does not read): only fields gloo
fills are used — collective sequence ids, op names, sizes, creation times and
the per-group ``last_enqueued`` / ``last_completed`` counters.
"""

from __future__ import annotations

from typing import Any

from trainwatch.diagnose.model import Evidence


def gather(ev: Evidence) -> None:
    """Fill ``ev.collectives["groups"]``: {pg: {"ranks": [...], "per_rank": {rank: seq view}}}."""
    groups = groups_of(ev.dumps)
    ev.collectives["groups"] = groups
    if ev.dumps and not groups:
        ev.cannot_see("collective sequences (no flight-recorder data in the rank dumps)")


def groups_of(dumps: dict[int, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{pg: {"desc", "per_rank": {rank: seq view}}} of the ranks' dumps (live or saved)."""
    groups: dict[str, dict[str, Any]] = {}
    for rank, dump in sorted(dumps.items()):
        trace = dump.get("flight_recorder")
        if not trace:
            continue
        by_pg: dict[str, dict[int, dict[str, Any]]] = {}
        descs: dict[str, str] = {}
        for entry in trace.get("entries", []):
            if entry.get("is_p2p"):
                continue
            pg, descs[pg] = _pg_name(entry)
            seq = entry.get("collective_seq_id")
            if isinstance(seq, int) and seq > 0:
                by_pg.setdefault(pg, {})[seq] = {
                    "op": entry.get("profiling_name"), "sizes": entry.get("input_sizes"),
                    "dtypes": entry.get("input_dtypes"), "created_ns": entry.get("time_created_ns"),
                    "frames": entry.get("frames", [])}
        status = trace.get("pg_status") or {}
        for pg in set(by_pg) | set(status):
            pg_status = status.get(pg) or {}
            entries = by_pg.get(pg, {})
            group = groups.setdefault(pg, {"per_rank": {}, "desc": descs.get(pg)})
            group["per_rank"][rank] = {
                "last_enqueued": pg_status.get("last_enqueued_collective",
                                               max(entries, default=0)),
                "last_completed": pg_status.get("last_completed_collective"),
                "entries": entries}
    return groups


def _pg_name(entry: dict[str, Any]) -> tuple[str, str]:
    """(name, description) of the entry's process group, e.g. ("0", "default_pg")."""
    pg = entry.get("process_group")
    if isinstance(pg, list) and len(pg) == 2:
        return str(pg[0]), str(pg[1])
    return str(entry.get("pg_id", "?")), ""
