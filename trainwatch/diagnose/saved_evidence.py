"""What the run directory kept from while a dead job still ran: the post-mortem's evidence.

After every process of a job is gone nothing can be asked any more, but earlier looks
left their answers in ``diagnostics/``: the ranks' dumps (``dump-rank-NNNNN.json``, Python
stacks and the flight-recorder trace, written when a live ``diagnose`` or the controller
asked) and the controller's evidence of a stall restart (``stall-<time>/``: copies of those
dumps, ``py-spy-rank-NNNNN.txt``). A saved look counts only if the rank's last process made
it (its pid; an earlier attempt's look is another process's) after that rank's last step
(one taken before says where the rank was before it moved on). Every file is listed: used,
not used and why, or unreadable and why, so the reader knows what the verdict rests on.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from trainwatch.contract.layout import DUMP_FORMAT, py_spy_file_name
from trainwatch.diagnose.flight_recorder import groups_of
from trainwatch.diagnose.model import Evidence
from trainwatch.errors import FormatError
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.safe_read import read_record, read_run_file

STALL_FOLDERS = "stall-*"
MAX_PY_SPY_BYTES = 256 << 10
_PY_SPY_PID = re.compile(r"^Process (\d+):", re.M)
_PY_SPY_FRAME = re.compile(r"^\s+(\S.*) \((.+):(\d+)\)\s*$")


def gather(run: RunDir, ev: Evidence) -> None:
    """Fill ``ev.saved`` for the ranks whose process is gone and that gave no fresh dump."""
    gone = {r: v for r, v in ev.ranks.items() if r not in ev.dumps
            and (v.get("process") or {}).get("status") in ("gone", "zombie")}
    if not gone:
        return
    saved: dict[str, Any] = {"dumps": {}, "py_spy": {}, "used": [], "not_used": [],
                             "unreadable": []}
    folders = sorted(p for p in run.diagnostics_dir.glob(STALL_FOLDERS) if p.is_dir())
    for rank, view in sorted(gone.items()):
        dumps = [run.dump_file(rank)] + [f / run.dump_file(rank).name for f in folders]
        for path in dumps:
            _consider(run, ev, saved, rank, view, path, _read_dump)
        for path in (f / py_spy_file_name(rank) for f in folders):
            _consider(run, ev, saved, rank, view, path, _read_py_spy)
    saved["used"] = sorted(v["path"] for k in ("dumps", "py_spy") for v in saved[k].values())
    if any(saved[k] for k in ("used", "not_used", "unreadable")):
        ev.saved = saved


def _consider(run: RunDir, ev: Evidence, saved: dict[str, Any], rank: int,
              view: dict[str, Any], path: Path, read: Any) -> None:
    if not os.path.lexists(path):
        return
    name = str(path.relative_to(run.root))
    try:
        kind, look = read(path, run.root)
    except NoStack as exc:
        saved["not_used"].append(f"{name}: {exc}")
        return
    except (OSError, FormatError, ValueError) as exc:
        why = getattr(exc, "detail", None) or str(exc)
        saved["unreadable"].append(f"{name}: {why}")
        ev.cannot_see(f"{name}: unreadable ({why})")
        return
    taken, pid = look["time"], look.get("pid")
    progress = _last_progress(ev, view)
    if pid != view.get("pid"):
        saved["not_used"].append(f"{name}: of pid {pid}, not rank {rank}'s last process "
                                 f"(pid {view.get('pid')}): an earlier attempt")
    elif progress is not None and taken < progress:
        saved["not_used"].append(f"{name}: taken {progress - taken:.1f} s before rank "
                                 f"{rank}'s last step: where it was before it moved on")
    elif taken >= (saved[kind].get(rank) or {}).get("time", float("-inf")):
        old = saved[kind].get(rank)
        if old is not None:
            saved["not_used"].append(f"{old['path']}: a newer look at rank {rank} is used")
        saved[kind][rank] = {**look, "path": name}
    else:
        saved["not_used"].append(f"{name}: a newer look at rank {rank} is used")


class NoStack(ValueError):
    """A saved py-spy file that says why there is no stack (the rank was stopped, gone)."""


def _last_progress(ev: Evidence, view: dict[str, Any]) -> float | None:
    age = view.get("progress_age")
    return ev.collected_at - age if isinstance(age, (int, float)) else None


def _read_dump(path: Path, root: Path) -> tuple[str, dict[str, Any]]:
    dump = read_record(path, DUMP_FORMAT, root=root)
    taken, pid = dump.get("time"), dump.get("pid")
    if not isinstance(taken, (int, float)) or not isinstance(pid, int):
        raise ValueError("no time or pid in it")
    trace = dump.get("flight_recorder")
    if trace is not None:
        try:  # the analysis must not meet a trace it cannot read
            groups_of({0: dump})
        except (AttributeError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed flight-recorder trace ({exc})") from None
    return "dumps", {"time": float(taken), "pid": pid, "dump": dump}


def _read_py_spy(path: Path, root: Path) -> tuple[str, dict[str, Any]]:
    """A ``py-spy dump`` text the controller saved: its pid, when, the main thread's frames."""
    text = read_run_file(path, root, max_bytes=MAX_PY_SPY_BYTES).decode(errors="replace")
    pid = _PY_SPY_PID.search(text)
    if pid is None:
        raise NoStack(text.strip().splitlines()[0][:160] if text.strip() else "empty")
    return "py_spy", {"time": os.stat(path).st_mtime, "pid": int(pid[1]),
                      "frames": main_frames(text)}


def main_frames(text: str) -> list[dict[str, Any]]:
    """The main thread's frames of a ``py-spy dump`` text, innermost last (as a stack)."""
    frames: list[dict[str, Any]] = []
    inside = False
    for line in text.splitlines():
        if line.startswith("Thread "):
            if inside:
                break
            inside = '"MainThread"' in line
            continue
        frame = _PY_SPY_FRAME.match(line) if inside else None
        if frame:
            frames.append({"function": frame[1], "file": frame[2], "line": int(frame[3])})
    return frames[::-1]
