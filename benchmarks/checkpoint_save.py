"""How long until a checkpoint is durable through the public ``Checkpoints`` API, and how
does that compare with what users would otherwise run?

    python benchmarks/checkpoint_save.py [--dir DIR] [--mb 300] [--rounds 5]
        [--memory-snapshots off|auto|every_step] [--no-dcp] [--json]

A model plus AdamW state of about ``--mb`` MB of parameters' worth (default 300: a
289 MB state; ``--mb 30`` for a quick run) is saved on the disk holding ``DIR`` (default:
a temporary folder in the current directory, which must not be a tmpfs), in rounds. Each
round runs every contender once, in a rotating order, so the machine's load hits all of
them alike, and every ratio is taken within a round (paired), then summarised as its
median and min-max over the rounds. One warm-up round comes first and is not counted
(the first async save allocates its host buffers; its times are printed).

* ``Checkpoints.maybe_save`` then ``wait``, ``mode=sync`` and ``mode=async``, as a user's
  loop calls them: "blocked" until ``maybe_save`` returns, "durable" until ``wait``
  returns, i.e. the checkpoint is written, fsynced, renamed into place and checked (the
  benchmark then confirms it is the newest verified one, outside the timing);
* ``torch.save(state, path)`` + fsync of the file: the plain way to save;
* ``dd conv=fsync`` of the checkpoint's byte count: the disk's own pace (write
  throughput = dd's time / the save's time, same bytes);
* ``torch.distributed.checkpoint.async_save`` (one-rank gloo group): blocked until it
  returns, durable when its future resolves.

CPU seconds of the whole process (every thread) for the trainwatch saves and torch.save
are printed too: on a busy host the wall-time ratios follow the extra CPU (sha256, the
NaN/Inf check, async's copy), which the CPU ratio shows without the load's noise.

Memory snapshots are off by default (``--memory-snapshots auto`` for the default config):
with a save every step they add nothing a checkpoint does not hold, and at 1 GB their copy
to /dev/shm on the loop's thread was most of a sync save's time (issue #38); their own cost
is benchmarks/memory_snapshots.py's. ``--no-dcp`` leaves DCP out, for states whose extra
staging copy does not fit in memory.

Every contender deletes what it wrote after its timing, so each writes into the same
state of the file system. Goals: time to durable <= 1.1x torch.save + fsync, async never
slower than sync, write throughput >= 0.7 of dd; async blocked <= DCP's, <= 10 % of sync.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from trainwatch.rank.checkpoint import CheckpointConfig
from trainwatch.checkpoint_format.catalog import scan
from trainwatch.rank.checkpoint.checkpoints import Checkpoints
from trainwatch.checkpoint_format.manifest import verify
from trainwatch.rundir.atomic import fsync_file


def build_state(megabytes: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Weights are a third of the state (AdamW keeps two moments per parameter)."""
    params = megabytes * 1_000_000 // 12
    width = 1024
    layers = max(1, params // (width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                  for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)  # not saved: leaves memory for larger states
    return model, opt


def _on_tmpfs(folder: Path) -> bool:
    best, fstype = "", ""
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, point, kind, *_ = line.split()
            if str(folder.resolve()).startswith(point) and len(point) > len(best):
                best, fstype = point, kind
    return fstype in ("tmpfs", "ramfs")


def rounds(folder: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
           count: int, snapshots: str = "off", dcp_too: bool = True
           ) -> tuple[dict[str, list[float]], dict[str, float], int]:
    """A warm-up round, then ``count`` rounds in rotating order; seconds per contender."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    ckpts = {mode: Checkpoints(folder / mode, CheckpointConfig(
        mode=mode, every_steps=1, keep_last=1000, save_final=False,
        memory_snapshots=snapshots)) for mode in ("sync", "async")}
    times: dict[str, list[float]] = {k: [] for k in (
        "sync_blocked", "sync_durable", "async_blocked", "async_durable", "torch_save_fsync",
        "dd_fsync", "dcp_blocked", "dcp_durable", "sync_cpu", "async_cpu", "torch_save_cpu")}
    nbytes = [0]
    step = [0]

    def api(mode: str) -> Callable[[], None]:
        def run() -> None:
            ckpt = ckpts[mode]
            step[0] += 1
            cpu, started = time.process_time(), time.perf_counter()
            if not ckpt.maybe_save(step[0], model=model, optimizer=opt):
                raise SystemExit(f"{mode}: maybe_save did not save step {step[0]}")
            times[f"{mode}_blocked"].append(time.perf_counter() - started)
            ckpt.wait()
            times[f"{mode}_durable"].append(time.perf_counter() - started)
            times[f"{mode}_cpu"].append(time.process_time() - cpu)
            newest = scan(ckpt.checkpointer.folder)[0]
            check = verify(newest.path, full=False)
            if newest.step != step[0] or not check.ok:
                raise SystemExit(f"{mode}: step {step[0]} is not the newest verified checkpoint "
                                 f"({newest.path}: {check.reason})")
            nbytes[0] = check.bytes
            shutil.rmtree(newest.path)
        return run

    def torch_save() -> None:
        path = folder / "torch.pt"
        cpu, started = time.process_time(), time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, str(path))
        fsync_file(path)
        times["torch_save_fsync"].append(time.perf_counter() - started)
        times["torch_save_cpu"].append(time.process_time() - cpu)
        path.unlink()

    def dd() -> None:
        path = folder / "dd.bin"
        started = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=8M", f"count={nbytes[0]}",
                        "iflag=count_bytes", "conv=fsync", "status=none"], check=True)
        times["dd_fsync"].append(time.perf_counter() - started)
        path.unlink()

    def dcp_async() -> None:
        target = folder / "dcp"
        started = time.perf_counter()
        future = dcp.async_save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                                checkpoint_id=str(target))
        times["dcp_blocked"].append(time.perf_counter() - started)
        future.result()
        times["dcp_durable"].append(time.perf_counter() - started)
        shutil.rmtree(target)

    contenders = [api("sync"), api("async"), torch_save, dd] + ([dcp_async] if dcp_too else [])
    for run in contenders:  # warm-up, not counted
        run()
    first = {k: v.pop() for k, v in times.items() if v}
    for r in range(count):
        k = r % len(contenders)
        for run in contenders[k:] + contenders[:k]:
            run()
    for mode, ckpt in ckpts.items():
        ckpt.close(final=False)
        failed = ckpt.run.events("checkpoint_failed")
        if failed:
            raise SystemExit(f"{mode}: saves failed: {failed}")
    return times, first, nbytes[0]


RATIOS = {  # name: (numerator, denominator, goal)
    "sync_durable_over_torch_save": ("sync_durable", "torch_save_fsync", "<= 1.1"),
    "async_durable_over_torch_save": ("async_durable", "torch_save_fsync", "<= 1.1"),
    "async_over_sync_durable": ("async_durable", "sync_durable", "<= 1"),
    "sync_throughput_over_dd": ("dd_fsync", "sync_durable", ">= 0.7"),
    "async_throughput_over_dd": ("dd_fsync", "async_durable", ">= 0.7"),
    "async_over_dcp_blocked": ("async_blocked", "dcp_blocked", "<= 1"),
    "async_over_sync_blocked": ("async_blocked", "sync_blocked", "<= 0.1"),
    "dcp_durable_over_torch_save": ("dcp_durable", "torch_save_fsync", ""),
    "sync_cpu_over_torch_save": ("sync_cpu", "torch_save_cpu", ""),
    "async_cpu_over_torch_save": ("async_cpu", "torch_save_cpu", ""),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=".", help="a folder on the disk to measure (not tmpfs)")
    parser.add_argument("--mb", type=int, default=300,
                        help="parameters' worth in MB (the state is ~0.96x: 300 -> 289 MB)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--memory-snapshots", default="off", choices=("off", "auto", "every_step"),
                        help="the in-memory snapshots beside each save (default off: a save "
                             "every step leaves them nothing to add; their cost has its own "
                             "benchmark, memory_snapshots.py)")
    parser.add_argument("--no-dcp", action="store_true",
                        help="leave DCP out (its staging copy needs the state's size again)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if _on_tmpfs(Path(args.dir)):
        parser.error(f"--dir {args.dir} is on a tmpfs: measure a real disk")
    torch.manual_seed(0)
    model, opt = build_state(args.mb)
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="tw-ckpt-bench-", dir=args.dir) as tmp:
        times, first, nbytes = rounds(Path(tmp), model, opt, args.rounds,
                                           args.memory_snapshots, not args.no_dcp)
    ratios: dict[str, Any] = {}
    for name, (num, den, goal) in RATIOS.items():
        if not times[num] or not times[den]:
            continue
        per_round = [n / d for n, d in zip(times[num], times[den])]
        ratios[name] = {"median": statistics.median(per_round), "min": min(per_round),
                        "max": max(per_round), "per_round": per_round, "goal": goal}
    report = {
        "state_bytes": nbytes, "rounds": args.rounds, "memory_snapshots": args.memory_snapshots,
        "load_average_1m": [load_start, os.getloadavg()[0]],
        "seconds": times, "warm_up_seconds": first, "ratios": ratios,
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"checkpoint of {nbytes / 1e6:.0f} MB (model + AdamW) through Checkpoints, "
          f"{args.rounds} rounds + 1 warm-up, disk of {args.dir}, memory snapshots "
          f"{args.memory_snapshots}, load average "
          f"{load_start:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"  {'seconds':26} {'median':>8} {'min':>8} {'max':>8} {'warm-up':>8}")
    for key, values in times.items():
        if not values:
            continue
        print(f"  {key:26} {statistics.median(values):8.3f} {min(values):8.3f} "
              f"{max(values):8.3f} {first[key]:8.3f}")
    print(f"  {'paired ratio':34} {'median':>7} {'min-max':>13}  goal")
    for name, r in ratios.items():
        print(f"  {name:34} {r['median']:7.2f} {r['min']:6.2f}-{r['max']:<6.2f}  {r['goal']}")


if __name__ == "__main__":
    main()
