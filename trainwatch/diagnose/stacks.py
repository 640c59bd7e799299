"""Python stacks of live ranks: py-spy from outside, or the rank's own dump.

py-spy sees a rank even when its telemetry thread cannot answer (SIGSTOP, a
held GIL); the rank's dump works without ptrace permission. Both are kept; the
analysis reads ``main_stack``. Every failure is reported, never raised.
"""

from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from trainwatch.diagnose.model import Evidence

_NO_STACK = ("gone", "zombie", "unknown")
_STDLIB = re.compile(r"/lib/python3\.\d+/")


def gather(ev: Evidence, timeout: float, native: bool = False) -> None:
    pyspy = find_py_spy()
    live = {r: v for r, v in ev.ranks.items()
            if (v.get("process") or {}).get("status") not in _NO_STACK}
    if live and pyspy is None:
        ev.cannot_see("py-spy is not installed: stacks only from ranks that answer "
                      "control/dump (pip install py-spy)")
    elif live and pyspy is not None:
        with ThreadPoolExecutor(max_workers=min(8, len(live))) as pool:
            futures = {r: pool.submit(py_spy_dump, pyspy, v["pid"], timeout, native,
                                      v["process"].get("status") == "stopped")
                       for r, v in live.items()}
            for rank, future in futures.items():
                result = future.result()
                ev.stacks[rank] = result
                if result.get("error"):
                    ev.cannot_see(f"rank {rank}: py-spy: {result['error']}")
    for rank, dump in ev.dumps.items():
        if rank not in ev.stacks or ev.stacks[rank].get("error"):
            ev.stacks[rank] = {"source": "rank dump", "threads": [
                {"name": t.get("name"), "frames": t.get("frames", []),
                 "telemetry": bool(t.get("dumper"))} for t in dump.get("threads", [])]}


def find_py_spy() -> str | None:
    """py-spy on PATH, else next to this Python (installed into trainwatch's environment)."""
    return shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))


def py_spy_dump(pyspy: str, pid: int, timeout: float, native: bool,
                stopped: bool) -> dict[str, Any]:
    """One ``py-spy dump --json``; a stopped process is read without pausing it."""
    cmd = [pyspy, "dump", "--pid", str(pid), "--json"]
    if native and not stopped:
        cmd.append("--native")
    if stopped:
        cmd.append("--nonblocking")  # ptrace-pausing a SIGSTOPped process fails
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"source": "py-spy", "error": f"timed out after {timeout:g} s"}
    except OSError as exc:
        return {"source": "py-spy", "error": str(exc)}
    if proc.returncode != 0:
        return {"source": "py-spy", "error": _reason(proc.stderr)}
    try:
        threads = json.loads(proc.stdout)
    except ValueError:
        return {"source": "py-spy", "error": "unreadable py-spy output"}
    return {"source": "py-spy" + (" --native" if native and not stopped else ""),
            "threads": [{"name": t.get("thread_name") or str(t.get("thread_id")),
                         "tid": t.get("os_thread_id"),
                         "frames": [{"file": f.get("filename"), "line": f.get("line"),
                                     "function": f.get("name")}
                                    for f in reversed(t.get("frames", []))],
                         "telemetry": (t.get("thread_name") or "").startswith(
                             "trainwatch-telemetry"),
                         "active": t.get("active"), "owns_gil": t.get("owns_gil")}
                        for t in threads]}


def _reason(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for i, line in enumerate(lines):
        if "permission denied" in line.lower() or "operation not permitted" in line.lower():
            return "no permission to attach (ptrace; run as the job's user or root)"
        if line.startswith("Error:"):
            cause = next((ln for ln in lines[i + 1:i + 4] if ln[:2].rstrip(":").isdigit()), "")
            return (line[6:].strip() + (f" ({cause.split(':', 1)[-1].strip()})" if cause else ""))
    return lines[-1] if lines else "py-spy failed"


def main_thread(stack: dict[str, Any] | None) -> dict[str, Any] | None:
    """The rank's main thread (py-spy or dump view), or None when unknown."""
    if not stack or not stack.get("threads"):
        return None
    threads = stack["threads"]
    main = next((t for t in threads if t.get("name") == "MainThread"), None)
    return main or next((t for t in threads if not t.get("telemetry")), threads[0])


def main_stack(stack: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Frames of the rank's main thread (innermost last), or [] when unknown."""
    main = main_thread(stack)
    return main.get("frames", []) if main else []


def qualified(frame: dict[str, Any]) -> str:
    """``re.match``, ``train.step``: a frame's function with its module (from the path)."""
    path = short_path(frame.get("file"))
    module = path.rsplit("/", 1)[-1] if path.startswith("/") else path
    module = module.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    return f"{module}.{frame.get('function')}"


def format_frames(frames: list[dict[str, Any]], limit: int = 12) -> list[str]:
    return [f"{short_path(f.get('file'))}:{f.get('line')} in {f.get('function')}"
            for f in frames[-limit:]]


def short_path(path: Any) -> str:
    """Library files by their import path (torch/utils/data/...); the user's code in full."""
    text = str(path)
    for marker in ("site-packages/", "dist-packages/"):
        if marker in text:
            return text.split(marker, 1)[1]
    match = _STDLIB.search(text)
    return text[match.end():] if match else text
