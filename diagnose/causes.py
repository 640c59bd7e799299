"""Why a live rank does not move, from the kernel (its threads' waits) and its source.

``thread_waits`` (trainwatch/host/procinfo.py) says what each thread of the rank is
blocked in; the rank's stacks say which Python line asked for it.  A deadlock between
the rank's own threads comes first (it explains everything else), then what the main
thread waits for.  Every cause kind has a section in runbooks/TrainingStalled.md.
"""

from __future__ import annotations

from typing import Any

from trainwatch.diagnose import locks
from trainwatch.diagnose.stacks import main_stack, short_path

# Waits that explain a stall by themselves; a futex or poll wait is what every rank
# waiting in a collective shows too, so it explains nothing on its own.
_TELLING = ("file_lock", "fifo_open", "file_open", "pipe", "fifo", "socket", "file_io", "disk_io")
RUNBOOK_SECTIONS = {
    "deadlock": "deadlock", "lock": "lock", "file_lock": "file-lock", "fifo_open": "fifo",
    "fifo": "fifo", "pipe": "pipe", "socket": "socket", "file_io": "file-io",
    "file_open": "file-io", "disk_io": "disk-io",
}


def rank_cause(view: dict[str, Any], stack: dict[str, Any] | None) -> dict[str, Any] | None:
    """The cause of one local rank's wait (``kind`` + details + ``runbook``), or None."""
    process = view.get("process") or {}
    kernel = {t["tid"]: t for t in process.get("thread_waits") or [] if "tid" in t}
    threads = (stack or {}).get("threads") or []
    cause = locks.find_deadlock(threads, kernel) if threads else None
    if cause is None:
        main = kernel.get(view.get("pid"))
        wait = (main or {}).get("wait") or {}
        frames = main_stack(stack)
        if wait.get("kind") in _TELLING:
            cause = dict(wait)
        elif wait.get("kind") == "futex" or (not main and frames):
            awaited = locks.thread_locks(frames)["awaited"] if frames else None
            if awaited:
                cause = {"kind": "lock", "lock": awaited["lock"],
                         "at": f"{awaited['file']}:{awaited['line']}",
                         "held": [h["lock"] for h in locks.thread_locks(frames)["held"]]}
        if cause is not None and main:
            cause["thread"] = {"tid": main["tid"], "name": main.get("name"),
                               "wchan": main.get("wchan"), "syscall": main.get("syscall")}
    if cause is not None:
        cause["runbook"] = f"TrainingStalled#{RUNBOOK_SECTIONS.get(cause['kind'], 'diagnosis')}"
    return cause


def innermost_line(frames: list[dict[str, Any]]) -> str | None:
    """'file:line: source' of the innermost Python frame: the call a builtin blocks in."""
    if not frames:
        return None
    f = frames[-1]
    text = locks.source_line(f.get("file"), f.get("line"))
    where = f"{short_path(f.get('file'))}:{f.get('line')} in {f.get('function')}"
    return f"{where}: {text}" if text else where


def describe(cause: dict[str, Any]) -> str:
    """One line a human reads: what the rank waits for, and who holds the other end."""
    kind = cause.get("kind")
    if kind == "deadlock":
        return "deadlock: " + "; ".join(
            f"thread {_thread(link['thread'])} waits for {link['waits_for']} "
            f"({short_path(link['at'])}), held by thread {_thread(link['held_by'])} "
            f"(taken at {short_path(link['taken_at'])})" for link in cause["threads"])
    if kind == "lock":
        held = f" while holding {', '.join(cause['held'])}" if cause.get("held") else ""
        return (f"waits for lock {cause['lock']} ({short_path(cause['at'])}){held}; "
                "no thread of this process is shown holding it")
    if kind == "file_lock":
        holder = cause.get("holder")
        who = (f"held by pid {holder['pid']} ({holder['cmdline'] or '?'})" if holder
               else "held by a process not visible here (another node or pid namespace)")
        return f"waits for a file lock ({cause.get('lock') or '?'}) on " \
               f"{cause.get('path') or '?'}{_mount(cause)}, {who}"
    if kind == "fifo_open":
        return f"blocked opening FIFO {cause.get('path') or '?'}{_mount(cause)}: " + \
            _peers(cause.get("peers"), "no other process has it open (nobody will write)")
    if kind in ("pipe", "fifo"):
        return f"blocked in {cause.get('direction')} on a {kind} " \
               f"{cause.get('path') or ''}".rstrip() + ": " + \
            _peers(cause.get("peers"), "no other process holds its other end")
    if kind == "socket":
        peer = cause.get("peer")
        who = (f"peer pid {peer['pid']} ({peer['cmdline'] or '?'})" if peer
               else "the peer is not on this host")
        return (f"blocked in {cause.get('direction')} on a {cause.get('protocol', '?')} socket "
                f"{cause.get('local') or '?'} -> {cause.get('remote') or '?'}; {who}")
    if kind in ("file_io", "file_open", "disk_io"):
        what = "uninterruptible I/O" if kind == "disk_io" else f"{cause.get('direction') or 'open'}"
        return f"blocked in {what} on {cause.get('path') or cause.get('wchan') or '?'}" + \
            _mount(cause)
    return str(kind)


def _thread(t: dict[str, Any]) -> str:
    return f"{t.get('name')} (tid {t.get('tid')})"


def _mount(cause: dict[str, Any]) -> str:
    m = cause.get("mount")
    return f" (on {m['mountpoint']}, {m['fstype']} {m['source']})" if m else ""


def _peers(peers: list[dict[str, Any]] | None, none: str) -> str:
    if not peers:
        return none
    return "other end held by " + ", ".join(f"pid {p['pid']} ({p['cmdline'] or '?'})"
                                            for p in peers[:3])
