"""How long does a checkpoint save block the training loop, async vs sync, and how close
does the writer get to the disk's own sequential write speed?

    python benchmarks/checkpoint_save.py [--dir DIR] [--mb 128] [--repeats 7] [--json]

A model plus AdamW state of about ``--mb`` MB (default 128) is saved through
``Checkpointer.after_step`` in both modes, side by side, on the disk holding ``DIR``
(default: a temporary folder in the current directory).  "Blocked" is the time
``after_step`` takes to return: for sync the whole write, for async the gather and the
copy to host memory.  The goal: async blocks at most 10 % of sync.  Write
throughput is compared with a plain sequential write + fsync of the same number of bytes
to the same directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trainwatch.rundir import RunDir
from trainwatch.trainer.checkpoint import CheckpointConfig, Checkpointer


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
    return model, opt


def time_saves(folder: Path, state, repeats: int) -> dict[str, dict[str, float]]:
    """Sync and async saves, alternating, so both see the same machine load."""
    ckpts = {}
    for mode in ("sync", "async"):
        RunDir(folder / mode).create()
        ckpts[mode] = Checkpointer(CheckpointConfig(mode=mode, every_steps=1, keep_last=1,
                                                    save_final=False), folder / mode).start()
    blocked: dict[str, list[float]] = {"sync": [], "async": []}
    for step in range(1, repeats + 1):
        for mode, ckpt in ckpts.items():
            started = time.perf_counter()
            ckpt.after_step(step, state)
            blocked[mode].append(time.perf_counter() - started)
            ckpt.wait()  # the next save starts with nothing in flight, in both modes
    results = {}
    for mode, ckpt in ckpts.items():
        ckpt.close()
        run = RunDir(folder / mode)
        saved, failed = run.events("checkpoint_saved"), run.events("checkpoint_failed")
        if failed or len(saved) != repeats:
            raise SystemExit(f"{mode}: saves failed: {failed}")
        results[mode] = {"blocked_seconds": statistics.median(blocked[mode]),
                         "write_seconds": statistics.median(e["write_seconds"] for e in saved),
                         "bytes": saved[-1]["bytes"]}
        shutil.rmtree(folder / mode)
    return results


def plain_write_seconds(folder: Path, nbytes: int, repeats: int) -> float:
    """A sequential write of ``nbytes`` from memory in 8 MiB chunks, then fsync: the disk's
    own pace.  The source is ``nbytes`` of distinct memory, as a checkpoint's is (one small
    chunk written again and again would stay in the CPU cache and flatter the disk)."""
    data = memoryview(os.urandom(nbytes))
    times = []
    for i in range(repeats):
        path = folder / f"plain-{i}.bin"
        started = time.perf_counter()
        with open(path, "wb") as fh:
            for offset in range(0, nbytes, 8 << 20):
                fh.write(data[offset:offset + (8 << 20)])
            fh.flush()
            os.fsync(fh.fileno())
        times.append(time.perf_counter() - started)
        path.unlink()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=".", help="a folder on the disk to measure")
    parser.add_argument("--mb", type=int, default=128, help="state size in MB (>= 100)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, opt = build_state(args.mb)
    state = lambda: {"model": model.state_dict(), "optimizer": opt.state_dict(),
                     "data": {"position": 0}}
    with tempfile.TemporaryDirectory(prefix="tw-ckpt-bench-", dir=args.dir) as tmp:
        folder = Path(tmp)
        results = time_saves(folder, state, args.repeats)
        nbytes = results["sync"]["bytes"]
        plain = plain_write_seconds(folder, nbytes, args.repeats)
    sync, async_ = results["sync"], results["async"]
    report = {
        "state_bytes": nbytes, "repeats": args.repeats,
        "sync_blocked_seconds": sync["blocked_seconds"],
        "async_blocked_seconds": async_["blocked_seconds"],
        "async_over_sync_blocked_ratio": async_["blocked_seconds"] / sync["blocked_seconds"],
        "checkpoint_write_seconds": async_["write_seconds"],
        "plain_write_seconds": plain,
    }
    report["checkpoint_write_bytes_per_second"] = nbytes / report["checkpoint_write_seconds"]
    report["plain_write_bytes_per_second"] = nbytes / plain
    report["write_throughput_ratio"] = (report["checkpoint_write_bytes_per_second"]
                                        / report["plain_write_bytes_per_second"])
    if args.json:
        print(json.dumps(report, indent=1))
        return
    mb = nbytes / 1e6
    print(f"state: {mb:.0f} MB (model + AdamW), median of {args.repeats} saves, disk of {args.dir}")
    print(f"  loop blocked, sync save : {sync['blocked_seconds'] * 1000:9.1f} ms")
    print(f"  loop blocked, async save: {async_['blocked_seconds'] * 1000:9.1f} ms  "
          f"({report['async_over_sync_blocked_ratio']:.1%} of sync; goal <= 10%)")
    print(f"  checkpoint write        : {report['checkpoint_write_seconds']:9.3f} s  "
          f"({report['checkpoint_write_bytes_per_second'] / 1e6:.0f} MB/s, serialize + sha256 "
          "+ fsync)")
    print(f"  plain sequential write  : {plain:9.3f} s  "
          f"({report['plain_write_bytes_per_second'] / 1e6:.0f} MB/s, write + fsync)")
    print(f"  write throughput ratio  : {report['write_throughput_ratio']:.2f} of the disk's own")


if __name__ == "__main__":
    main()
