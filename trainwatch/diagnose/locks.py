"""Which locks a thread holds and which one it waits for, read from its Python source.

A thread blocked in a builtin (``lock.acquire``, ``with lock:``) leaves no frame of the
lock itself; its innermost Python frame is the line that asks for the lock, and its
outer frames sit inside the ``with`` blocks of the locks it already holds.  Reading
those lines with ``ast`` names both, as the source spells them (``self.lock``,
``LOCK_A``).  Two threads where each waits for what the other holds, both in a futex
wait in the kernel, are a deadlock that can be shown, not guessed.
"""

from __future__ import annotations

import ast
import functools
import linecache
from typing import Any

MAX_SOURCE_BYTES = 2 << 20


@functools.lru_cache(maxsize=64)
def _tree(path: str) -> ast.AST | None:
    try:
        with open(path, "rb") as fh:
            source = fh.read(MAX_SOURCE_BYTES + 1)
        if len(source) > MAX_SOURCE_BYTES:
            return None
        return ast.parse(source, filename=path)
    except (OSError, SyntaxError, ValueError):
        return None


def source_line(path: Any, line: Any) -> str | None:
    """The text of one source line (stripped), or None when the file cannot be read."""
    if not isinstance(path, str) or not isinstance(line, int) or line <= 0:
        return None
    text = linecache.getline(path, line).strip()
    return text or None


def _lock_calls(node: ast.AST) -> list[str]:
    """``X`` for every ``X.acquire(...)`` call inside node."""
    return [ast.unparse(n.func.value) for n in ast.walk(node)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "acquire"]


def frame_locks(path: Any, line: Any,
                innermost: bool) -> tuple[list[tuple[str, int]], str | None]:
    """((lock expression, line taken) held at this frame's line, the awaited one if innermost)."""
    tree = _tree(path) if isinstance(path, str) and isinstance(line, int) else None
    if tree is None:
        return [], None
    held: list[tuple[str, int]] = []
    awaited = None
    for node in ast.walk(tree):
        if not isinstance(node, (ast.With, ast.AsyncWith)):
            continue
        end = getattr(node, "end_lineno", None) or node.lineno
        if not node.lineno <= line <= end:
            continue
        names = [ast.unparse(item.context_expr) for item in node.items]
        if innermost and node.lineno == line:
            awaited = names[-1]
            held += [(n, node.lineno) for n in names[:-1]]
        elif node.body and node.body[0].lineno <= line:
            held += [(n, node.lineno) for n in names]
    if innermost and awaited is None:
        for node in ast.walk(tree):
            if isinstance(node, ast.stmt) and node.lineno == line:
                calls = _lock_calls(node)
                if calls:
                    awaited = calls[0]
                    break
    return held, awaited


def condition_wait(frames: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A thread parked in ``threading``'s ``Condition.wait`` (``Event.wait``, a queue's
    ``get``...): what its own code waits on, where, and the locks it still holds.

    ``Condition.wait`` releases the condition's lock and blocks on a private ``waiter``
    lock until someone notifies: it is no lock wait, and the condition is not held.
    """
    if not frames or not _in_threading(frames[-1]) or \
            frames[-1].get("function") not in ("Condition.wait", "wait"):
        return None
    i = len(frames) - 1
    while i >= 0 and _in_threading(frames[i]):
        i -= 1
    if i < 0:
        return None
    caller, api = frames[i], str(frames[i + 1].get("function"))
    held: list[str] = []
    for frame in frames[:i + 1]:
        held += [n for n, _ in frame_locks(frame.get("file"), frame.get("line"), False)[0]]
    obj = _waited_object(caller.get("file"), caller.get("line"))
    return {"kind": "event" if api.startswith("Event.") else "condition", "object": obj,
            "api": api, "at": f"{caller.get('file')}:{caller.get('line')}",
            "held": [h for h in held if h != obj]}  # the condition itself was released


def _in_threading(frame: dict[str, Any]) -> bool:
    return str(frame.get("file")).endswith("/threading.py")


def _waited_object(path: Any, line: Any) -> str | None:
    """``X`` of the ``X.wait(...)`` (or ``wait_for``, ``get``...) call at that line."""
    tree = _tree(path) if isinstance(path, str) and isinstance(line, int) else None
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                getattr(node, "lineno", None) == line:
            return ast.unparse(node.func.value)
    return None


def thread_locks(frames: list[dict[str, Any]]) -> dict[str, Any]:
    """Held locks (with where each was taken) and the awaited one, for one thread's stack."""
    held: list[dict[str, Any]] = []
    awaited = None
    for i, frame in enumerate(frames):  # outermost first
        innermost = i == len(frames) - 1
        names, wants = frame_locks(frame.get("file"), frame.get("line"), innermost)
        held += [{"lock": n, "file": frame.get("file"), "line": at} for n, at in names]
        if wants:
            awaited = {"lock": wants, "file": frame.get("file"), "line": frame.get("line")}
    return {"held": held, "awaited": awaited}


def find_deadlock(threads: list[dict[str, Any]],
                  kernel: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """A cycle of threads each waiting for a lock another one of them holds.

    ``threads``: ``{"name", "tid", "frames"}``; ``kernel``: tid -> ``thread_waits`` entry.
    A thread counts only while the kernel shows it blocked (a futex wait, or sleeping when
    the kernel facts are not readable), so a thread that merely passes a ``with`` line
    is not taken for a waiter.
    """
    info: dict[int | str | None, dict[str, Any]] = {}  # by tid, else by name
    for t in threads:
        facts = thread_locks(t.get("frames") or [])
        tid = t.get("tid")
        k = kernel.get(tid) if tid is not None else None
        blocked = (k is None or k.get("state") in ("S", "D")) and \
            (k is None or (k.get("wait") or {}).get("kind") in ("futex", None))
        if facts["awaited"] and blocked:
            info[tid or t.get("name")] = {**facts, "thread": t}
    holder_of: dict[str, int | str | None] = {}
    for holder, facts in info.items():
        for h in facts["held"]:
            holder_of.setdefault(h["lock"], holder)
    for member, facts in info.items():
        self_held = _held_by_itself(facts)
        if self_held:  # a plain Lock taken again by the thread that holds it
            awaited = facts["awaited"]
            waits = kernel.get(member) if isinstance(member, int) else None
            who = _who(facts["thread"])
            return {"kind": "deadlock", "threads": [{
                "thread": who, "waits_for": awaited["lock"],
                "at": f"{awaited['file']}:{awaited['line']}", "held_by": who,
                "taken_at": f"{self_held['file']}:{self_held['line']}",
                "kernel": (waits or {}).get("wchan")}]}
    for start in info:
        chain: list[int | str | None] = []
        key: int | str | None = start
        while key in info and key not in chain:
            chain.append(key)
            key = holder_of.get(info[key]["awaited"]["lock"])
        if key == start and len(chain) >= 2:
            links = []
            for i, member in enumerate(chain):
                nxt = chain[(i + 1) % len(chain)]
                waits = kernel.get(member) if isinstance(member, int) else None  # tid unknown
                lock = info[member]["awaited"]["lock"]
                taken = next(h for h in info[nxt]["held"] if h["lock"] == lock)
                awaited = info[member]["awaited"]
                links.append({
                    "thread": _who(info[member]["thread"]), "waits_for": lock,
                    "at": f"{awaited['file']}:{awaited['line']}",
                    "held_by": _who(info[nxt]["thread"]),
                    "taken_at": f"{taken['file']}:{taken['line']}",
                    "kernel": (waits or {}).get("wchan")})
            return {"kind": "deadlock", "threads": links}
    return None


def _held_by_itself(facts: dict[str, Any]) -> dict[str, Any] | None:
    """The thread's own hold of the lock it waits for (an RLock would not block there)."""
    return next((h for h in facts["held"] if h["lock"] == facts["awaited"]["lock"]), None)


def _who(thread: dict[str, Any]) -> dict[str, Any]:
    return {"name": thread.get("name"), "tid": thread.get("tid")}
