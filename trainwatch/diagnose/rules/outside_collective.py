"""Rule: a rank the others wait for, alive but somewhere else (data loading, file I/O, a lock,
its DataLoader worker), located from its stack, its phase and its kernel wait."""

from __future__ import annotations

import re
from typing import Any

from trainwatch.diagnose import causes, workers
from trainwatch.diagnose.casefile import Analysis, cause_lines, in_collective
from trainwatch.diagnose.model import Finding
from trainwatch.diagnose.stacks import format_frames

# Where a rank that is not in a collective is, from its stack (first match wins).
_WHERE = (
    ("data loading", re.compile(r"torch/utils/data|__getitem__|__next__|_next_data|dataset",
                                re.I)),
    ("a lock or condition (possible deadlock)", re.compile(
        r"threading\.py:\d+ in (acquire|wait)|\bacquire\b|_wait_for_tstate_lock|Condition\.wait")),
    ("a file lock", re.compile(r"\b(fcntl\.)?(flock|lockf)\b")),
    ("GPU work (device synchronisation)", re.compile(r"torch/cuda|synchronize", re.I)),
    ("file I/O", re.compile(r"serialization\.py|\b(write|fsync|flush|read|open)\b|_save|shutil")),
)


_CAUSE_WHERE = {"deadlock": "a deadlock", "lock": "a lock",
                "event": "a wait for an event", "condition": "a wait on a condition",
                "file_lock": "a file lock"}


_PHASE_WHERE = {"data": "data loading", "checkpoint": "file I/O (checkpoint)",
                "eval": "evaluation"}


def check_outside_collective(a: Analysis) -> list[Finding]:
    """Ranks the others wait for that are alive but somewhere else (data, I/O, a lock)."""
    if not a.stalled:
        return []
    behind: dict[int, list[str]] = {}
    for pg, g in a.groups.items():
        if not g["waiting"]:
            continue
        for rank, b in g["behind"].items():
            behind.setdefault(rank, []).append(
                f"process group {pg} ({g['desc']}): ranks {g['waiting']} wait in collective "
                f"#{g['frontier']} {g['frontier_op']}; rank {rank} last entered "
                f"#{b['last_enqueued']}" + (" (completed)" if not b["in_collective"] else ""))
    confidence = "high"
    if not a.groups:
        # No flight recorder: fall back to stacks — who is not inside torch.distributed.
        confidence = "medium"
        stacks = {r: a.stack(r) for r in a.running if r not in a.explained and a.stack(r)}
        waiting = [r for r, s in stacks.items() if in_collective(s)]
        if waiting:
            for rank, s in stacks.items():
                if not in_collective(s):
                    behind[rank] = [f"rank(s) {waiting} are inside a torch.distributed call "
                                    "(their stacks); this rank is not"]
    findings = []
    for rank, lines in sorted(behind.items()):
        if rank in a.explained or rank not in a.ev.ranks:
            continue
        a.explained.add(rank)
        stack = a.stack(rank)
        where = locate(a.ev.ranks[rank].get("phase"), stack)
        evidence = [a.where_line(rank), *lines]
        if not stack:
            evidence.append("no stack for this rank (see 'could not see')")
        cause = causes.rank_cause(a.ev.ranks[rank], a.ev.stacks.get(rank))
        worker = workers.blocked_worker(a.ev.ranks[rank])
        if worker:  # the rank waits for a batch: the worker process it waits for is the culprit
            cause = worker["cause"]
            if cause:
                cause["process"] = {"pid": worker["pid"], "role": "DataLoader worker"}
            evidence.append(f"DataLoader worker pid {worker['pid']} (a child process of rank "
                            f"{rank}) is inside a batch while the rank waits for it: "
                            + " <- ".join(reversed(worker["stack"][-4:])))
            evidence += [f"worker pid {worker['pid']}: {line}"
                         for line in cause_lines(cause, worker["frames"])]
            where = f"data loading (its DataLoader worker pid {worker['pid']} is blocked)"
        else:
            evidence += cause_lines(cause, stack)
        kind = cause.get("kind") if cause else None
        if isinstance(kind, str) and not worker:
            where = _CAUSE_WHERE.get(kind, where)
        category = "storage" if (where.startswith("file I/O") or kind == "disk_io") and a.proc(
            rank) == "disk_sleep" else "rank_stuck"
        title = (f"rank {rank} is stuck outside a collective, in {where}, while the "
                 "others wait" + (f": {causes.describe(cause)}" if cause else ""))
        elsewhere = [(pg, g) for pg, g in a.groups.items() if rank in g["waiting"]]
        if elsewhere:  # it waits in another group's collective: follow the chain there
            pg, g = elsewhere[0]
            title = (f"rank {rank} waits in collective #{g['frontier']} of process group {pg} "
                     "while the others wait for it")
            evidence.append(f"process group {pg}: rank(s) {sorted(g['behind']) or '?'} have not "
                            f"entered #{g['frontier']} {g['frontier_op']}")
        findings.append(Finding(
            category, title, ranks=[rank], nodes=[a.node(rank)], confidence=confidence,
            evidence=evidence, runbook="TrainingStalled",
            next_command=f"py-spy dump --pid {a.ev.ranks[rank].get('pid')} --native",
            stack=format_frames(stack), cause=cause))
    return findings


def locate(phase: str | None, stack: list[dict[str, Any]]) -> str:
    """Where a rank is, from its stack (preferred) or its phase."""
    text = "\n".join(format_frames(stack, limit=len(stack)))
    inner = causes.innermost_line(stack)  # a builtin (acquire, flock, open) leaves no frame
    text += f"\n{inner}" if inner else ""
    for where, pattern in _WHERE:
        if text and pattern.search(text):
            return where
    return _PHASE_WHERE.get(str(phase), f"phase '{phase}' (see its stack)")
