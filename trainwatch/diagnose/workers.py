"""DataLoader worker processes of a rank that waits for its data.

A rank whose main thread waits in ``_try_get_data`` waits for one of its worker processes
(children of the rank): its own stack says only "waiting for a batch". Each worker's stack
(py-spy) and kernel wait tell which one is stuck and on what: a worker idle between batches
waits in ``index_queue.get`` of ``_worker_loop``; one inside the dataset or the collate
function is the one the rank waits for.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psutil

from trainwatch.diagnose import causes, stacks
from trainwatch.diagnose.model import Evidence
from trainwatch.host.procinfo import thread_waits

MAX_WORKERS = 16  # workers looked at per rank
_WAITS_FOR_WORKER = re.compile(r"_try_get_data|_get_data")
_IN_WORKER_LOOP = re.compile(r"torch/utils/data/_utils/worker\.py")
_WORKING = re.compile(r"fetch\.py|__getitem__|__getitems__|collate", re.I)


def gather(ev: Evidence, timeout: float) -> None:
    """Fill ``data_workers`` of each local rank whose main thread waits for a batch."""
    pyspy = stacks.find_py_spy()
    for view in ev.ranks.values():
        frames = stacks.main_stack(ev.stacks.get(view["rank"]))
        if not any(_WAITS_FOR_WORKER.search(str(f.get("function"))) for f in frames):
            continue
        try:
            children = psutil.Process(view["pid"]).children()[:MAX_WORKERS]
        except psutil.Error:
            continue
        if pyspy is None:
            ev.cannot_see(f"rank {view['rank']}: its DataLoader workers' stacks (no py-spy)")
            continue
        with ThreadPoolExecutor(max_workers=max(1, min(4, len(children)))) as pool:
            dumps = list(pool.map(lambda c: stacks.py_spy_dump(pyspy, c.pid, timeout, False,
                                                               False), children))
        view["data_workers"] = [worker(c.pid, d) for c, d in zip(children, dumps)]


def worker(pid: int, dump: dict[str, Any]) -> dict[str, Any]:
    """One child's stack, whether it is a DataLoader worker busy with a batch
    (``blocked``), and what its main thread waits for in the kernel (``cause``)."""
    frames = stacks.main_stack(dump)
    is_worker = any(_IN_WORKER_LOOP.search(str(f.get("file"))) for f in frames)
    blocked = is_worker and any(_WORKING.search(f"{f.get('file')} {f.get('function')}")
                                for f in frames)
    cause = causes.rank_cause({"pid": pid, "process": {"thread_waits": thread_waits(pid)}},
                              dump) if blocked else None
    return {"pid": pid, "data_loader_worker": is_worker, "blocked": blocked,
            "stack": stacks.format_frames(frames), "frames": frames,
            "error": dump.get("error"), "cause": cause}


def blocked_worker(view: dict[str, Any]) -> dict[str, Any] | None:
    """The rank's one DataLoader worker busy with a batch, or None (none, or several)."""
    blocked = [w for w in view.get("data_workers") or [] if w.get("blocked")]
    return blocked[0] if len(blocked) == 1 else None
