"""Where one in-memory snapshot's cost goes: the loop thread's CPU per part, in-process.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/memory_snapshots_parts.py [--steps 330] [--total]

The reference model (memory_snapshots.py's ``ref``) trains through ``Checkpoints`` with
``memory_snapshots: every_step``; after each real step the previous write is waited for
(outside the figures), then ``maybe_save`` snapshots. Each part of the snapshot is wrapped
and timed on the loop's thread with ``time.thread_time`` (CPU, not wall: on a shared VM
the wall time is mostly other processes), the first 30 snapshots left out; the writer
thread's time holding the GIL per snapshot (its ``writer_gil_seconds``: it takes the
loop's GIL, so it counts against the loop too) beside them. Median and 10th-90th
percentiles, with the load average. A/B: run it from each worktree in turn.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WARMUP = 30
PARTS = (("trainwatch.rank.checkpoint.checkpoints", "Checkpoints", "maybe_save"),
         ("trainwatch.rank.memory_snapshots.snapshotter", "MemorySnapshots", "after_step"),
         ("trainwatch.rank.checkpoint.checkpoints", "Checkpoints", "_trees"),
         ("trainwatch.rank.memory_snapshots.capture", "HostCopy", "take"),
         ("trainwatch.rank.memory_snapshots.capture", "HostCopy", "copy"),
         ("trainwatch.rank.memory_snapshots.overlap", "Overlap", "split"),
         ("trainwatch.rank.checkpoint.rng", None, "capture_raw"),
         ("trainwatch.rank.memory_snapshots.rng_watch", "RngWatch", "capture_raw"),
         ("trainwatch.rank.memory_snapshots.writer", "Writer", "submit"),
         ("trainwatch.rank.memory_snapshots.snapshotter", "MemorySnapshots", "_measure"))


def _timed(times: dict[str, list[int]], label: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return fn(*args, **kwargs)
        started = time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            times.setdefault(label, []).append(time.thread_time_ns() - started)
    return wrapper


def _wrap(times: dict[str, list[int]], total: bool = False) -> None:
    import importlib

    for module_name, owner_name, name in PARTS:
        if total and name not in ("maybe_save", "after_step"):
            continue
        try:
            owner: Any = importlib.import_module(module_name)
        except ImportError:  # the code before may not have it
            continue
        if owner_name is not None:
            owner = getattr(owner, owner_name, None)
        if owner is not None and hasattr(owner, name):
            label = name if name != "capture_raw" else "RNG states"
            setattr(owner, name, _timed(times, label, getattr(owner, name)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=330)
    parser.add_argument("--total", action="store_true",
                        help="time the whole snapshot only (no wrapper around its parts)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    import memory_snapshots as bench

    times: dict[str, list[int]] = {}
    _wrap(times, args.total)
    model, opt, train_step = bench._build("ref")
    folder = Path(tempfile.mkdtemp(prefix="tw-snap-parts-"))
    ckpt = bench._checkpoints(folder, "every_step")
    memory = ckpt.checkpointer.memory
    load = os.getloadavg()[0]
    for step in range(1, args.steps + 1):
        train_step()
        memory.wait()
        if step == WARMUP:
            times.clear()
        ckpt.maybe_save(step, model=model, optimizer=opt)
        if step > WARMUP:
            memory.wait()
            times.setdefault("writer's GIL", []).append(int(memory._writer_gil * 1e9))
    bench._close(ckpt)
    shutil.rmtree(folder, ignore_errors=True)
    print(f"reference model, every_step, {args.steps - WARMUP} snapshots; load average "
          f"{load:.1f}-{os.getloadavg()[0]:.1f}; loop-thread CPU per call, µs: median (p10-p90)")
    for label, values in times.items():
        values.sort()
        n = len(values)
        print(f"  {label:14} n={n:4}  {values[n // 2] / 1e3:7.1f} "
              f"({values[n // 10] / 1e3:.1f}-{values[9 * n // 10] / 1e3:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
