"""``telemetry_overhead.py --per-step``: the loop-side cost of telemetry and of each
optional check, in microseconds a step (issue #38), at their default intervals.

Not a script of its own: ``telemetry_overhead.py`` imports it (see its docstring).
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import shutil
import statistics
import struct
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch
import torch.distributed as dist
from _gloo_loop import init_gloo, reference_data, telemetry_step  # benchmarks/_gloo_loop.py
from torch.nn.parallel import DistributedDataParallel as DDP

from trainwatch.rank.telemetry import Telemetry
from trainwatch.trainer.config import load_config
from trainwatch.trainer.train import Ranks, build_training_state, checkpoint_state


class Instructions:
    """The calling thread's user-space instructions (``perf_event_open``), or why not."""

    def __init__(self) -> None:
        self.fd, self.why = -1, ""
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            attr = bytearray(128)  # struct perf_event_attr (PERF_ATTR_SIZE_VER7 and less)
            struct.pack_into("IIQ", attr, 0, 0, 128, 1)  # HARDWARE, size, INSTRUCTIONS
            struct.pack_into("Q", attr, 40, 1 << 5 | 1 << 6)  # exclude_kernel, exclude_hv
            number = {"x86_64": 298, "aarch64": 241}.get(os.uname().machine)
            if number is None:
                self.why = f"no perf_event_open number known for {os.uname().machine}"
                return
            fd = libc.syscall(number, ctypes.create_string_buffer(bytes(attr)), 0, -1, -1, 0)
            if fd < 0:
                self.why = f"perf_event_open: {os.strerror(ctypes.get_errno())}"
            self.fd = fd
        except OSError as exc:
            self.why = repr(exc)

    def read(self) -> int:
        return struct.unpack("q", os.read(self.fd, 8))[0] if self.fd >= 0 else 0


@dataclass
class Config:
    """One column of the comparison: what runs in the loop."""

    name: str
    tel: Telemetry
    ddp: Any
    state: Any
    digests: bool = False
    snapshots: Any = None  # a Checkpointer whose after_step runs after each step
    wall: list[float] = field(default_factory=list)  # per round: mean seconds a step
    cpu: list[float] = field(default_factory=list)
    instructions: list[float] = field(default_factory=list)
    count: int = 0


def amortized(times: list[float], first: int, intervals: tuple[int, ...]) -> float:
    """The mean step of a block, robust to a stray slow step: the steps grouped by which
    intervals fall on them (plain, exchange, checked, ...), each group's median weighted by
    its size. A check's step counts at its share; a heartbeat or a page fault landing on one
    step does not."""
    groups: dict[tuple[bool, ...], list[float]] = {}
    for n, t in enumerate(times, first):
        groups.setdefault(tuple((n + 1) % i == 0 for i in intervals), []).append(t)
    return sum(statistics.median(g) * len(g) for g in groups.values()) / len(times)


def heartbeat_cpu() -> float:
    """CPU seconds used so far by this process's telemetry heartbeat threads."""
    ids = {t.native_id for t in threading.enumerate() if t.name.startswith("trainwatch-telemetry")}
    return sum(t.user_time + t.system_time for t in psutil.Process().threads() if t.id in ids)


def per_step_costs(args: argparse.Namespace) -> None:
    rank, world = init_gloo()
    cfg = load_config(None, args.overrides)
    ranks = Ranks(rank, int(os.environ.get("LOCAL_RANK", rank)), world, torch.device("cpu"),
                  True, 0)
    scratch = tempfile.mkdtemp(prefix="trainwatch-bench-")
    data = reference_data(cfg, scratch, rank)
    def model() -> tuple[Any, Any]:
        """A DDP model and its training state, the same at every call (seeded)."""
        state = build_training_state(cfg, data, ranks)
        return DDP(state.model), state

    hooked, hooked_state = model()
    every = cfg.telemetry
    on = Telemetry(os.path.join(scratch, "run"), rank=rank, local_rank=ranks.local_rank,
                   world_size=world, flops_per_token=hooked_state.model.flops_per_token(),
                   heartbeat_interval=every.heartbeat_interval,
                   exchange_every=every.exchange_every).start()
    off = Telemetry(os.path.join(scratch, "off"), enabled=False)
    on.check_reduction(hooked, every=every.reduction_every)
    on.check_replicas(hooked_state.model, every=every.replica_every)
    digest = on._loop.replicas  # the one the publisher reads; its model follows the config
    on._loop.replicas = None
    assert digest is not None
    # Each configuration steps a model of its own, so each step follows another model's
    # (its parameters and optimizer state out of the caches) alike; a shared model ran warm
    # after itself, one of its own cold (a control measured that alone at +52 and +89 us a
    # step at 3 ms, more than the checks cost).
    # The checksum's (DDP takes one hook) is shared only by the snapshots' configurations,
    # placed so that none follows another in the rotation. The last is an A/A control:
    # "off" again, on a model of its own; its figure is the comparison's noise.
    configs = [Config("off", off, *model()),
               Config("+ reduction checksum", on, hooked, hooked_state, digests=True),
               Config("telemetry", on, *model()),
               Config("+ replica digests", on, *model(), digests=True),
               Config("off again (A/A control)", off, *model())]
    if args.snapshots:
        before, auto = snapshot_configs(scratch, on, hooked, hooked_state)
        configs[3:3], configs[5:5] = [before], [auto]
    # Every check falls in each block the same number of times: its mean is amortized.
    intervals = tuple(sorted({n for n in (every.replica_every, every.reduction_every,
                                          every.exchange_every) if n}))
    block = math.lcm(*intervals)
    counter = Instructions()

    def step(c: Config, n: int) -> None:
        """One step of trainer/train.py's loop (grad_accum 1), as the trainer times it."""
        telemetry_step(c.tel, n, c.ddp, c.state, cfg)
        if c.snapshots is not None:
            c.snapshots.after_step(n + 1, lambda: checkpoint_state(c.state))

    def run(first: int, steps: int, keep: bool) -> None:
        """Steps ``first`` .. of every configuration, one step of each in turn (the order
        rotating), so that machine load hits each alike; each keeps its step numbers, so
        its checks fall on the steps they would."""
        times: dict[str, tuple[list[float], list[float]]] = {c.name: ([], []) for c in configs}
        for n in range(first, first + steps):
            for i in range(len(configs)):
                c = configs[(i + n) % len(configs)]
                on._loop.replicas = digest if c.digests else None
                digest.model = c.state.model
                wall, cpu, count = time.perf_counter(), time.thread_time(), counter.read()
                step(c, n)
                times[c.name][0].append(time.perf_counter() - wall)
                times[c.name][1].append(time.thread_time() - cpu)
                c.count += counter.read() - count
        if keep:
            for c in configs:
                c.wall.append(amortized(times[c.name][0], first, intervals))
                c.cpu.append(amortized(times[c.name][1], first, intervals))
                c.instructions.append(c.count / steps)
        for c in configs:
            c.count = 0

    run(0, 2 * block, keep=False)  # warm-up: every configuration's path, untimed
    load, beats, process = [os.getloadavg()[0]], heartbeat_cpu(), time.process_time()
    loop = time.thread_time()
    for r in range(args.repeats):
        run((2 + r * args.rounds) * block, args.rounds * block, keep=True)
    loop = time.thread_time() - loop
    others = time.process_time() - process - loop
    beats = heartbeat_cpu() - beats
    load.append(os.getloadavg()[0])
    on.close()
    for c in configs:
        if c.snapshots is not None:
            c.snapshots.close()
    if rank == 0:
        report(configs, block, args, (beats, others - beats), load, counter, world,
               hooked_state.model)
    shutil.rmtree(scratch, ignore_errors=True)
    dist.destroy_process_group()


def snapshot_configs(scratch: str, on: Telemetry, ddp: Any, state: Any) -> list[Config]:
    """Everything above plus a ``Checkpointer``'s ``after_step`` with in-memory snapshots
    off, then at ``auto`` (their difference is the snapshots' cost; no durable saves)."""
    from trainwatch.rank.checkpoint import CheckpointConfig
    from trainwatch.rank.checkpoint.checkpointer import Checkpointer
    made = []
    for name, mode in (("+ checkpointer, snapshots off", "off"),
                       ("+ memory snapshots (auto)", "auto")):
        config = CheckpointConfig(every_steps=0, save_final=False, resume="never",
                                  fsync=False, memory_snapshots=mode,
                                  memory_snapshots_dir=os.path.join(scratch, f"shm-{mode}"))
        made.append(Config(name, on, ddp, state, digests=True,
                           snapshots=Checkpointer(config, os.path.join(scratch, "run"))))
    return made


def report(configs: list[Config], block: int, args: argparse.Namespace,
           background: tuple[float, float], load: list[float], counter: Instructions,
           world: int, model: torch.nn.Module) -> None:
    base = configs[0]
    steps = args.repeats * args.rounds * block
    step_ms = statistics.median(base.wall) * 1e3
    print(f"{sum(p.numel() for p in model.parameters()):,} params, {world} gloo rank(s), "
          f"torch threads {torch.get_num_threads()}; step off {step_ms:.2f} ms; {args.repeats} "
          f"repeats of {args.rounds * block} steps per configuration, one step of each in "
          f"turn; load average {load[0]:.2f} -> {load[1]:.2f}")
    telemetry_steps = sum(1 for c in configs if c.tel.enabled) * steps
    print(f"background, per telemetry step: heartbeat thread (flush, status, beat; another "
          f"core, but it holds the GIL while it works) {background[0] / telemetry_steps * 1e6:.1f}"
          f" us CPU; other threads (gloo, snapshot writer) {background[1] / telemetry_steps * 1e6:.1f}"
          " us CPU")
    def line(what: str, d: list[float]) -> str:
        return (f"{what} {statistics.median(d) * 1e6:+.1f} us ({min(d) * 1e6:+.1f} to "
                f"{max(d) * 1e6:+.1f})")

    order = ("telemetry", "+ replica digests", "+ reduction checksum")  # each adds to the last
    for c in sorted(configs[1:], key=lambda c: order.index(c.name) - 9 if c.name in order else 0):
        wall = [a - b for a, b in zip(c.wall, base.wall)]
        cpu = [a - b for a, b in zip(c.cpu, base.cpu)]
        ratio = [a / b for a, b in zip(c.wall, base.wall)]
        text = (f"{c.name:30s} per step vs off: {line('wall', wall)}, ratio "
                f"{statistics.median(ratio):.4f} ({min(ratio):.4f}-{max(ratio):.4f}); "
                f"{line('loop CPU', cpu)}")
        if counter.fd >= 0:
            ins = [a - b for a, b in zip(c.instructions, base.instructions)]
            text += f"; instructions {statistics.median(ins):+,.0f}"
        print(text)
    if counter.fd < 0:
        print(f"instructions: not counted ({counter.why}; hardware counters not exposed "
              "here: see --instructions, callgrind)")
    print("goal: telemetry + both checks <= 50 us per step, amortized, at defaults")
