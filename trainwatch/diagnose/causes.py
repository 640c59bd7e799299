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
from trainwatch.host.procinfo import TELLING_WAITS, describe_wait

RUNBOOK_SECTIONS = {
    "deadlock": "deadlock", "lock": "lock", "event": "event", "condition": "event",
    "file_lock": "file-lock", "fifo_open": "fifo", "fifo": "fifo", "pipe": "pipe",
    "socket": "socket", "file_io": "file-io", "file_open": "file-io", "disk_io": "disk-io",
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
        if wait.get("kind") in TELLING_WAITS:
            cause = dict(wait)
        elif (wait.get("kind") == "futex" or (not main and frames)) and \
                locks.condition_wait(frames):
            cause = locks.condition_wait(frames)
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
        return "deadlock: " + "; ".join(_link(link) for link in cause["threads"])
    if kind == "lock":
        held = f" while holding {', '.join(cause['held'])}" if cause.get("held") else ""
        return (f"waits for lock {cause['lock']} ({short_path(cause['at'])}){held}; "
                "no thread of this process is shown holding it")
    if kind in ("event", "condition"):
        what = (f"event {cause['object']}" if kind == "event" else
                f"condition {cause['object']}") if cause.get("object") else cause["api"]
        nobody = "nothing has set" if kind == "event" else "nothing has notified"
        holds = (f"while holding {', '.join(cause['held'])}" if cause.get("held")
                 else "holding no lock")
        return f"waits for {what} ({short_path(cause['at'])}) that {nobody}, {holds}"
    return describe_wait(cause)


def _link(link: dict[str, Any]) -> str:
    waits = f"thread {_thread(link['thread'])} waits for "
    if link["held_by"] == link["thread"]:
        return (waits + f"lock {link['waits_for']} ({short_path(link['at'])}) that it holds "
                f"itself (taken at {short_path(link['taken_at'])})")
    return (waits + f"{link['waits_for']} ({short_path(link['at'])}), held by thread "
            f"{_thread(link['held_by'])} (taken at {short_path(link['taken_at'])})")


def _thread(t: dict[str, Any]) -> str:
    return f"{t.get('name')} (tid {t.get('tid')})"
