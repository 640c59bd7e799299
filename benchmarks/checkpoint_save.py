"""How long does a checkpoint save block the training loop, how long until it is on disk,
and how does that compare with what users would otherwise run?

    python benchmarks/checkpoint_save.py [--dir DIR] [--mb 128] [--repeats 7] [--json]

A model plus AdamW state of about ``--mb`` MB (default 128) is saved, on the disk holding
``DIR`` (default: a temporary folder in the current directory), in rounds; each round runs
every contender once, back to back, so machine load hits all of them alike:

* trainwatch ``Checkpointer.after_step``, sync and async: "blocked" is the time it takes
  to return (async: gather + copy to host memory), "durable" until the save is fsynced
  and renamed into place (async: ``wait``);
* trainwatch's writer alone (``write_checkpoint`` on a host copy): time to durable;
* ``torch.save(state, path)`` + fsync of the file: the plain way to save;
* ``torch.distributed.checkpoint.async_save`` (DCP, one-rank gloo group): blocked until
  it returns, durable when its future resolves (its writer fsyncs);
* a plain sequential write + fsync of the same number of bytes: the disk's own pace.

Goals: writer time to durable <= 1.2x torch.save + fsync; write throughput >= 0.7 of the
plain write; async blocking <= DCP async_save's (and <= 10 % of sync).
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
from trainwatch.trainer.checkpoint.snapshot import HostSnapshot
from trainwatch.trainer.checkpoint.writer import Payload, write_checkpoint


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


def rounds(folder: Path, state, repeats: int) -> dict[str, list[float]]:
    """Every contender once per round, in a rotating order; seconds per contender."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    ckpts = {}
    for mode in ("sync", "async"):
        RunDir(folder / mode).create()
        ckpts[mode] = Checkpointer(CheckpointConfig(mode=mode, every_steps=1, keep_last=1,
                                                    save_final=False), folder / mode).start()
    host = HostSnapshot().capture(state())  # what the async writer thread writes from
    host_shared = {k: v for k, v in host.items() if k != "data"}
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(host))
    times: dict[str, list[float]] = {k: [] for k in (
        "sync_blocked", "async_blocked", "async_durable", "writer_durable",
        "torch_save_fsync", "dcp_blocked", "dcp_durable", "plain_write")}
    data = memoryview(os.urandom(nbytes))

    def trainwatch_sync(step: int) -> None:
        started = time.perf_counter()
        ckpts["sync"].after_step(step, state)
        times["sync_blocked"].append(time.perf_counter() - started)

    def trainwatch_async(step: int) -> None:
        started = time.perf_counter()
        ckpts["async"].after_step(step, state)
        times["async_blocked"].append(time.perf_counter() - started)
        ckpts["async"].wait()
        times["async_durable"].append(time.perf_counter() - started)

    def writer(step: int) -> None:
        started = time.perf_counter()
        written = write_checkpoint(folder / "writer", Payload(step, host_shared,
                                                              [{"data": {"position": 0}}]))
        times["writer_durable"].append(time.perf_counter() - started)
        shutil.rmtree(written.path)

    def torch_save(step: int) -> None:
        path = folder / f"torch-{step}.pt"
        started = time.perf_counter()
        torch.save(state(), str(path))
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        times["torch_save_fsync"].append(time.perf_counter() - started)
        path.unlink()

    def dcp_async(step: int) -> None:
        target = folder / f"dcp-{step}"
        started = time.perf_counter()
        future = dcp.async_save(state(), checkpoint_id=str(target))
        times["dcp_blocked"].append(time.perf_counter() - started)
        future.result()
        times["dcp_durable"].append(time.perf_counter() - started)
        shutil.rmtree(target)

    def plain(step: int) -> None:
        path = folder / f"plain-{step}.bin"
        started = time.perf_counter()
        with open(path, "wb") as fh:
            for offset in range(0, nbytes, 8 << 20):
                fh.write(data[offset:offset + (8 << 20)])
            fh.flush()
            os.fsync(fh.fileno())
        times["plain_write"].append(time.perf_counter() - started)
        path.unlink()

    contenders = [trainwatch_sync, trainwatch_async, writer, torch_save, dcp_async, plain]
    for step in range(1, repeats + 1):
        k = step % len(contenders)
        for run in contenders[k:] + contenders[:k]:
            run(step)
    for mode, ckpt in ckpts.items():
        ckpt.close()
        failed = RunDir(folder / mode).events("checkpoint_failed")
        if failed:
            raise SystemExit(f"{mode}: saves failed: {failed}")
    times["bytes"] = [float(nbytes)]
    return times


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=".", help="a folder on the disk to measure")
    parser.add_argument("--mb", type=int, default=128, help="state size in MB (>= 100)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, opt = build_state(args.mb)
    def state():
        return {"model": model.state_dict(), "optimizer": opt.state_dict(),
                "data": {"position": 0}}
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="tw-ckpt-bench-", dir=args.dir) as tmp:
        times = rounds(Path(tmp), state, args.repeats)
    nbytes = int(times.pop("bytes")[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    spread = {k: (min(v), max(v)) for k, v in times.items()}
    report = {
        "state_bytes": nbytes, "repeats": args.repeats,
        "load_average_1m": [load_start, os.getloadavg()[0]],
        "seconds_median": med, "seconds_min_max": spread,
        "async_over_sync_blocked_ratio": med["async_blocked"] / med["sync_blocked"],
        "async_over_dcp_blocked_ratio": med["async_blocked"] / med["dcp_blocked"],
        "writer_over_torch_save_durable_ratio": med["writer_durable"] / med["torch_save_fsync"],
        "async_over_torch_save_durable_ratio": med["async_durable"] / med["torch_save_fsync"],
        "write_throughput_ratio": med["plain_write"] / med["writer_durable"],
        "dcp_over_torch_save_durable_ratio": med["dcp_durable"] / med["torch_save_fsync"],
    }
    # per round ratios (paired), for the spread of the headline ratios
    report["writer_over_torch_save_per_round"] = sorted(
        w / t for w, t in zip(times["writer_durable"], times["torch_save_fsync"]))
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"state: {nbytes / 1e6:.0f} MB (model + AdamW), {args.repeats} rounds, disk of "
          f"{args.dir}, load average {load_start:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"  {'contender':34} {'median s':>9} {'min':>8} {'max':>8}")
    for key in ("sync_blocked", "async_blocked", "dcp_blocked", "async_durable",
                "writer_durable", "torch_save_fsync", "dcp_durable", "plain_write"):
        lo, hi = spread[key]
        print(f"  {key:34} {med[key]:9.3f} {lo:8.3f} {hi:8.3f}")
    per_round = report["writer_over_torch_save_per_round"]
    print(f"  writer durable / torch.save+fsync : {report['writer_over_torch_save_durable_ratio']:.2f}"
          f" (per round {per_round[0]:.2f}-{per_round[-1]:.2f}; goal <= 1.2)")
    print(f"  write throughput / plain write    : {report['write_throughput_ratio']:.2f}"
          " (goal >= 0.7)")
    print(f"  async blocked / DCP async_save    : {report['async_over_dcp_blocked_ratio']:.2f}"
          " (goal <= 1)")
    print(f"  async blocked / sync blocked      : {report['async_over_sync_blocked_ratio']:.1%}"
          " (goal <= 10 %)")
    print(f"  DCP durable / torch.save+fsync    : {report['dcp_over_torch_save_durable_ratio']:.2f}")


if __name__ == "__main__":
    main()
