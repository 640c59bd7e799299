"""Instructions a step of telemetry's loop side, counted by callgrind (issue #38).

    python benchmarks/loop_instructions.py            # needs valgrind and a C compiler

Two counts that machine load cannot move (unlike the CPU time of ``telemetry_overhead.py
--per-step`` on a shared VM), per pair of blocks, order fixed, after a warm-up:

* the telemetry's bookkeeping alone, no model: a step block with the four phase blocks and
  a ``record`` of five scalars, telemetry on (default settings, the timing window every 10
  steps; no heartbeat: its flush is another thread's work) against ``enabled=False``;
* the reduction checksum's DDP communication hook on an unchecked step: the backward of a
  small DDP model (one gloo rank, one bucket) with the hook against the same without one.

Counts are of the whole process (every thread: gloo's callback included), so they are an
upper bound of the loop thread's. Compare versions by running each one's copy of this file.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import tempfile

from _callgrind import counts_under_callgrind  # benchmarks/_callgrind.py


def counted(dump_shim: str, block: int, pairs: int) -> None:
    """The measured run (under callgrind): dumps a count after each block."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainwatch.rank.telemetry import Telemetry

    dump = ctypes.CDLL(dump_shim).trainwatch_dump
    scratch = tempfile.mkdtemp(prefix="trainwatch-instructions-")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    on = Telemetry(os.path.join(scratch, "on"), heartbeat_interval=3600,
                   max_pending=(2 + pairs) * block * 2, flops_per_token=1.0).start()
    off = Telemetry(os.path.join(scratch, "off"), enabled=False)

    def steps(tel: Telemetry, first: int) -> None:
        for n in range(first, first + block):
            with tel.step(n) as record:
                for name in ("data", "forward", "backward", "optimizer"):
                    with tel.phase(name):
                        pass
                record.record(loss=1.0, grad_norm=2.0, lr=1e-3, tokens=64, samples=1)

    n = 0
    for tel in (on, off, on, off):  # warm-up
        steps(tel, n)
        n += block
    dump(b"setup")
    for i in range(pairs):
        for tel, label in ((on, "on"), (off, "off")):
            steps(tel, n)
            n += block
            dump(f"{label}-{i}".encode())

    torch.manual_seed(0)
    plain, hooked = DDP(torch.nn.Linear(64, 64)), DDP(torch.nn.Linear(64, 64))
    on.check_reduction(hooked, every=1 << 30)  # never a checked step
    x = torch.randn(4, 64)

    def backwards(ddp: DDP) -> None:
        for _ in range(block):
            ddp(x).sum().backward()

    for ddp in (plain, hooked, plain, hooked):  # warm-up (DDP's first backward builds buckets)
        backwards(ddp)
    dump(b"setup-hook")
    for i in range(pairs):
        for ddp, label in ((hooked, "hook"), (plain, "nohook")):
            backwards(ddp)
            dump(f"{label}-{i}".encode())
    on.close()
    dist.destroy_process_group()
    shutil.rmtree(scratch, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block", type=int, default=200, help="steps (backwards) per block")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--count-child", help=argparse.SUPPRESS)  # the run under callgrind
    args = parser.parse_args()
    if args.count_child:
        counted(args.count_child, args.block, args.pairs)
        return
    counts = counts_under_callgrind(__file__, ["--block", str(args.block),
                                              "--pairs", str(args.pairs)])
    for i in range(args.pairs):
        on, off = counts[f"on-{i}"] / args.block, counts[f"off-{i}"] / args.block
        hook, plain = counts[f"hook-{i}"] / args.block, counts[f"nohook-{i}"] / args.block
        print(f"pair {i}: bookkeeping on {on:,.0f}, off {off:,.0f}, +{on - off:,.0f} "
              f"instructions a step; backward with the checksum's hook (unchecked) "
              f"{hook:,.0f}, without {plain:,.0f}, +{hook - plain:,.0f}")


if __name__ == "__main__":
    main()
