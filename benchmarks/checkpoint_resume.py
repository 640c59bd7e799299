"""How long does ``Checkpoints.resume`` take, every file's digest verified, against the plain
``torch.load`` + ``load_state_dict`` of the same state?

    python benchmarks/checkpoint_resume.py [--dir DIR] [--mb 300] [--rounds 9] [--cold]
        [--json]

The state of benchmarks/checkpoint_save.py (a model plus AdamW, ``--mb`` MB of parameters'
worth: 300 -> 289 MB, 1000 -> 994 MB) is saved once through ``Checkpoints`` (sync) and once
with ``torch.save`` on the disk holding ``DIR`` (default: a temporary folder in the current
directory; not a tmpfs). Then, in rounds, each contender runs once, in alternating order
(the machine's load hits both alike), and the ratio is taken within each round (paired),
summarised as its median and min-max:

* ``tw_resume``: ``resume(model=, optimizer=)`` of a ``Checkpoints`` on that run directory
  (made before the timing: a job makes it anyway, to save): the newest checkpoint found,
  every file's size and xxh3-128 digest checked, the trees loaded into the model and
  optimizer, the RNGs restored;
* ``torch_resume``: ``torch.load(path, map_location="cpu", weights_only=True)`` of the
  ``torch.save`` file, then ``model.load_state_dict`` and ``optimizer.load_state_dict``.

Warm cache (default): the files sit in the page cache, as after a save or a restart on the
same node. ``--cold``: before each contender every file it reads is dropped from the page
cache (fsync, then ``posix_fadvise(POSIX_FADV_DONTNEED)``), so both read from the disk.
CPU seconds (the process, every thread) are printed too. Goal (issue #38, #33):
tw_resume / torch_resume <= 1.1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from checkpoint_save import _on_tmpfs, build_state  # this folder's save benchmark

from trainwatch.rank.checkpoint import CheckpointConfig
from trainwatch.rank.checkpoint.checkpoints import Checkpoints

CONTENDERS = ("tw_resume", "torch_resume")


def drop_cache(paths: list[Path]) -> None:
    """Clean pages of ``paths`` out of the page cache (dirty ones are written first)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def rounds(folder: Path, mb: int, count: int, cold: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model, opt = build_state(mb)
    config = CheckpointConfig(mode="sync", every_steps=1, keep_last=1000, save_final=False,
                              memory_snapshots="off")
    with Checkpoints(folder / "tw", config) as ckpt:
        ckpt.maybe_save(1, model=model, optimizer=opt)
    tw_files = sorted(p for p in (folder / "tw" / "checkpoints").rglob("*") if p.is_file())
    plain = folder / "torch.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, plain)
    seconds: dict[str, list[float]] = {f"{k}_{m}": [] for k in CONTENDERS for m in ("s", "cpu")}
    loads: list[float] = []

    def tw_resume() -> Callable[[], None]:
        ckpt = Checkpoints(folder / "tw", config)  # a job makes it anyway: not timed

        def run() -> None:
            if ckpt.resume(model=model, optimizer=opt) != 1:
                raise SystemExit("tw_resume: did not resume step 1")
        run.close = lambda: ckpt.close(final=False)  # type: ignore[attr-defined]
        return run

    def torch_resume() -> Callable[[], None]:
        def run() -> None:
            state = torch.load(plain, map_location="cpu", weights_only=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
        run.close = lambda: None  # type: ignore[attr-defined]
        return run

    makers = {"tw_resume": (tw_resume, tw_files), "torch_resume": (torch_resume, [plain])}
    for r in range(count + 1):  # round 0: warm-up, not counted
        order = CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]
        for name in order:
            maker, files = makers[name]
            run = maker()
            if cold:
                drop_cache(files)
            cpu, started = time.process_time(), time.perf_counter()
            run()
            wall, used = time.perf_counter() - started, time.process_time() - cpu
            run.close()  # type: ignore[attr-defined]
            if r:
                seconds[f"{name}_s"].append(wall)
                seconds[f"{name}_cpu"].append(used)
        loads.append(os.getloadavg()[0])
    nbytes = sum(p.stat().st_size for p in tw_files)
    return {"state_bytes": nbytes, "torch_save_bytes": plain.stat().st_size,
            "seconds": seconds, "load_average_1m": loads}


def spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "per_round": values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=".", help="a folder on the disk to measure (not tmpfs)")
    parser.add_argument("--mb", type=int, default=300,
                        help="parameters' worth in MB (the state is ~0.96x: 300 -> 289 MB)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--cold", action="store_true",
                        help="drop the files from the page cache before each contender")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if _on_tmpfs(Path(args.dir)):
        parser.error(f"--dir {args.dir} is on a tmpfs: measure a real disk")
    with tempfile.TemporaryDirectory(prefix="tw-resume-bench-", dir=args.dir) as tmp:
        result = rounds(Path(tmp), args.mb, args.rounds, args.cold)
    s = result["seconds"]
    result["ratios"] = {
        "resume_over_torch": {**spread([a / b for a, b in zip(s["tw_resume_s"],
                                                               s["torch_resume_s"])]),
                              "goal": "<= 1.1"},
        "resume_cpu_over_torch": {**spread([a / b for a, b in zip(s["tw_resume_cpu"],
                                                                   s["torch_resume_cpu"])]),
                                  "goal": ""}}
    result.update(rounds=args.rounds, cache="cold" if args.cold else "warm")
    if args.json:
        print(json.dumps(result, indent=1))
        return
    loads = result["load_average_1m"]
    print(f"resume of {result['state_bytes'] / 1e6:.0f} MB (model + AdamW), {args.rounds} "
          f"rounds + 1 warm-up, {result['cache']} cache, disk of {args.dir}, load average "
          f"{min(loads):.1f}-{max(loads):.1f}")
    print(f"  {'seconds':20} {'median':>8} {'min':>8} {'max':>8}")
    for key, values in s.items():
        print(f"  {key:20} {statistics.median(values):8.3f} {min(values):8.3f} "
              f"{max(values):8.3f}")
    for key, r in result["ratios"].items():
        print(f"  {key:24} {r['median']:6.2f} ({r['min']:.2f}-{r['max']:.2f})  {r['goal']}")


if __name__ == "__main__":
    main()
