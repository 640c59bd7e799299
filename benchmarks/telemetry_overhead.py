"""Telemetry overhead: median trainer step time with telemetry on vs off, side by side.

    python benchmarks/telemetry_overhead.py                      # one CPU process
    python benchmarks/telemetry_overhead.py --set model.width=256 --set model.layers=4
    torchrun --standalone --nproc-per-node 2 benchmarks/telemetry_overhead.py   # with DDP
    python benchmarks/telemetry_overhead.py   # on a machine with an NVIDIA GPU: uses CUDA

The step is the reference trainer's (data, forward, backward, clip, optimizer) on its
default config. Steps alternate one by one between a ``Telemetry`` at its default
settings and ``Telemetry(enabled=False)``, so changes in machine load hit both alike.
Printed, with the goal <= 1.005 for each ratio:

* median wall time per step, on vs off (the heartbeat thread's work falls on steps of
  either kind, so this figure shares it between the two);
* CPU time per step: the loop thread's, plus, for "on", the telemetry thread's CPU
  time spread over the "on" steps. CPU time moves far less than wall time when other
  programs share the machine;
* the telemetry work alone (no model): the loop thread's CPU time per step with
  telemetry on and off, blocks of steps alternating, at default settings (under DDP
  with the timing exchange), and the heartbeat thread's flush per step. It is the
  figure that machine load moves least, so compare versions of telemetry with it.

With ``--instructions`` (one process, needs ``valgrind`` and a C compiler) the same step
is then run under callgrind, which counts the user-space instructions the process
executes: machine load cannot move them, unlike wall time on a shared VM (kernel counters,
``perf stat``, are not exposed here). Pairs of blocks of ``--block`` steps, on and off,
order alternating, each block's count dumped on its own; the heartbeat's work runs in the
loop's thread at the end of each "on" block (flushing that block's steps), its fixed part
(status and beat files) counted once a beat, at the steps per beat the run above measured
(a second over the CPU time of a step off). Printed: the ratio of instructions per step on/off, median and range over
the pairs (goal <= 1.005).

With ``--per-step`` (issue #38: the cost in microseconds a step, not only as a ratio) the
script instead measures, in a DDP-wrapped reference step (gloo; one rank in this process,
or every rank under torchrun), the loop-side cost of each layer at its default interval:
telemetry alone, + replica digests, + the reduction checksum, and (counted apart) the
in-memory snapshots at ``auto``. Each configuration steps a model of its own (so each
step follows another model's alike), with an A/A control ("off" again) whose figure is
the comparison's noise. Rounds of one block per configuration, the order rotating per
round; a block is a multiple of the checks' intervals, so each block holds
its checked steps and its mean is the amortized cost. Per configuration, against the "off"
block of the same round: the extra wall time and loop-thread CPU per step in us (median
and range over rounds) and as a ratio; the heartbeat thread's CPU per telemetry step
beside it (it runs on another core, but holds the GIL while it works). Run it at a short
step (``--set model.layers=1 --set train.batch_size=1``, ~2-3 ms) and at the reference
step (no ``--set``, ~10 ms). Where the kernel exposes hardware counters
(``perf_event_open``), the loop thread's user-space instructions per step too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time

import psutil
import torch
from _callgrind import counts_under_callgrind  # benchmarks/_callgrind.py
from _gloo_loop import reference_data, telemetry_step  # benchmarks/_gloo_loop.py
from torch.nn.parallel import DistributedDataParallel as DDP

from trainwatch.trainer.config import load_config
from trainwatch.rank.telemetry import Telemetry
from trainwatch.trainer.train import build_training_state, setup_process_group


def telemetry_thread_cpu() -> float:
    """CPU seconds used so far by this process's telemetry heartbeat threads."""
    ids = {t.native_id for t in threading.enumerate() if t.name.startswith("trainwatch-telemetry")}
    return sum(t.user_time + t.system_time for t in psutil.Process().threads() if t.id in ids)


def count_instructions(args: argparse.Namespace, steps_per_beat: float) -> list[float]:
    """Run this script's step under callgrind; per pair, instructions per step on/off."""
    counts = counts_under_callgrind(__file__, [
        "--pairs", str(args.pairs), "--block", str(args.block),
        *[a for o in args.overrides for a in ("--set", o)]])
    ratios = []
    for i in range(args.pairs):
        beat = counts[f"beat-{i}"]
        on = (counts[f"on-{i}"] - beat) / args.block + beat / steps_per_beat
        ratios.append(on / (counts[f"off-{i}"] / args.block))
        print(f"  pair {i}: {on:,.0f} instructions per step on, "
              f"{counts[f'off-{i}'] / args.block:,.0f} off (beat {beat:,})")
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500, help="measured steps per mode")
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="trainer config override")
    parser.add_argument("--instructions", action="store_true",
                        help="then count instructions per step on/off under callgrind")
    parser.add_argument("--pairs", type=int, default=3, help="callgrind: pairs of blocks")
    parser.add_argument("--block", type=int, default=10, help="callgrind: steps per block")
    parser.add_argument("--count-child", help=argparse.SUPPRESS)  # the run under callgrind
    parser.add_argument("--per-step", action="store_true",
                        help="the us per step of telemetry and each check (issue #38)")
    parser.add_argument("--rounds", type=int, default=10,
                        help="--per-step: blocks of the checks' interval per repeat")
    parser.add_argument("--repeats", type=int, default=3, help="--per-step: repeats")
    parser.add_argument("--snapshots", action="store_true",
                        help="--per-step: also count in-memory snapshots (auto)")
    args = parser.parse_args()
    if args.per_step:
        from step_cost import per_step_costs  # benchmarks/step_cost.py
        per_step_costs(args)
        return

    cfg = load_config(None, args.overrides)
    ranks = setup_process_group(cfg)
    scratch = tempfile.mkdtemp(prefix="trainwatch-bench-")
    state = build_training_state(cfg, reference_data(cfg, scratch, ranks.rank), ranks)
    model = state.model
    ddp = DDP(model, device_ids=[ranks.device.index] if ranks.device.type == "cuda" else None
              ) if ranks.distributed else model
    tokens = cfg.train.batch_size * cfg.model.context
    cuda = ranks.device.type == "cuda"

    def step(tel: Telemetry, n: int) -> None:
        """One step of trainer/train.py's loop (grad_accum 1)."""
        telemetry_step(tel, n, ddp, state, cfg, ranks.device)

    def bookkeeping_cost(blocks: int = 20, block: int = 200) -> tuple[float, float, float]:
        """Loop-thread CPU seconds per step of the telemetry calls alone (no model work),
        on and off, in alternating blocks; and the flush's (resolve, format and append
        the records) as the heartbeat thread would do it, per step."""
        bare = Telemetry(os.path.join(scratch, "bare"), rank=ranks.rank,
                         world_size=ranks.world_size, device=ranks.device, flops_per_token=1.0,
                         heartbeat_interval=3600, max_pending=blocks * block).start()
        value = torch.zeros((), device=ranks.device)
        cpu: dict[bool, float] = {True: 0.0, False: 0.0}
        for b in range(2 * blocks):
            tel = bare if b % 2 == 0 else off
            started = time.thread_time()
            for n in range(b // 2 * block, (b // 2 + 1) * block):
                with tel.step(n) as record:
                    for name in ("data", "forward", "backward", "optimizer"):
                        with tel.phase(name):
                            pass
                    record.record(loss=value, grad_norm=value, lr=1e-3, tokens=tokens,
                                  samples=1)
            cpu[tel.enabled] += time.thread_time() - started
        started = time.thread_time()
        bare.close()  # flushes all pending steps at once, as the heartbeat thread would
        steps = blocks * block
        return cpu[True] / steps, cpu[False] / steps, (time.thread_time() - started) / steps

    if args.count_child:
        import ctypes
        dump = ctypes.CDLL(args.count_child).trainwatch_dump
        # The heartbeat's work runs here, in step with the loop, not on a clock.
        on = Telemetry(os.path.join(scratch, "run"), rank=ranks.rank, world_size=1,
                       device=ranks.device, flops_per_token=model.flops_per_token(),
                       heartbeat_interval=1e9).start()
        off = Telemetry(os.path.join(scratch, "off"), enabled=False)
        n = 0
        for tel in (off, on, off, on):  # warm both paths up
            for _ in range(3):
                step(tel, n)
                n += 1
        on._beat_once()
        dump(b"setup")
        for i in range(args.pairs):
            for enabled in ((True, False) if i % 2 == 0 else (False, True)):
                for _ in range(args.block):
                    step(on if enabled else off, n)
                    n += 1
                if enabled:
                    on._beat_once()  # flushes this block's steps
                dump(f"{'on' if enabled else 'off'}-{i}".encode())
            on._beat_once()  # nothing pending: the part of a beat paid once per beat
            dump(f"beat-{i}".encode())
        on.close()
        shutil.rmtree(scratch, ignore_errors=True)
        return

    on = Telemetry(os.path.join(scratch, "run"), rank=ranks.rank, local_rank=ranks.local_rank,
                   world_size=ranks.world_size, device=ranks.device,
                   flops_per_token=model.flops_per_token()).start()
    off = Telemetry(os.path.join(scratch, "off"), enabled=False)
    for n in range(args.warmup_steps):
        step(off, n)
    wall: dict[bool, list[float]] = {True: [], False: []}
    loop_cpu: dict[bool, list[float]] = {True: [], False: []}
    telemetry_cpu_started = telemetry_thread_cpu()
    for n in range(2 * args.steps):
        enabled = n % 2 == 0
        started, started_cpu = time.perf_counter(), time.thread_time()
        step(on if enabled else off, len(wall[enabled]))
        if cuda:
            torch.cuda.synchronize()  # the harness's clock, the same in both modes
        wall[enabled].append(time.perf_counter() - started)
        loop_cpu[enabled].append(time.thread_time() - started_cpu)
    telemetry_cpu = telemetry_thread_cpu() - telemetry_cpu_started
    on.close()
    loop_on, loop_off, flush = bookkeeping_cost()

    if ranks.rank == 0:
        wall_on, wall_off = statistics.median(wall[True]), statistics.median(wall[False])
        cpu_off = statistics.fmean(loop_cpu[False])
        cpu_on = statistics.fmean(loop_cpu[True]) + telemetry_cpu / args.steps
        device = torch.cuda.get_device_name(ranks.device) if cuda else "cpu"
        print(f"device {device}, world size {ranks.world_size}, {model.num_params():,} params, "
              f"{args.steps} steps per mode, interleaved")
        print(f"median wall time per step: on {wall_on * 1e3:.3f} ms, off {wall_off * 1e3:.3f} ms,"
              f" ratio {wall_on / wall_off:.4f}  (goal <= 1.005)")
        print(f"CPU time per step incl. the telemetry thread: on {cpu_on * 1e3:.3f} ms, off "
              f"{cpu_off * 1e3:.3f} ms, ratio {cpu_on / cpu_off:.4f}  (goal <= 1.005); "
              f"loop thread {(statistics.fmean(loop_cpu[True]) - cpu_off) * 1e6:+.1f} us, "
              f"telemetry thread {telemetry_cpu / args.steps * 1e6:.1f} us per step")
        print(f"telemetry work alone (CPU, no model): loop {loop_on * 1e6:.1f} us per step on, "
              f"{loop_off * 1e6:.1f} us off, +{(loop_on - loop_off) * 1e6:.1f} us; heartbeat "
              f"flush {flush * 1e6:.1f} us per step; together "
              f"{1 + (loop_on - loop_off + flush) / wall_off:.4f} x the median step time off")
        if args.instructions and not ranks.distributed:
            # Steps per beat from the CPU time of a step: the wall time swings with load.
            steps_per_beat = on.heartbeat_interval / cpu_off
            print(f"instructions per step under callgrind ({args.pairs} pairs of "
                  f"{args.block}-step blocks, a beat every {steps_per_beat:.0f} steps):")
            ratios = count_instructions(args, steps_per_beat)
            print(f"instructions per step, on/off: median {statistics.median(ratios):.4f} "
                  f"({min(ratios):.4f}-{max(ratios):.4f})  (goal <= 1.005)")
    shutil.rmtree(scratch, ignore_errors=True)
    if ranks.distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
