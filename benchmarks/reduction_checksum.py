"""Overhead of the reduction checksum (``Telemetry.check_reduction``) as a ratio of step time.

    OMP_NUM_THREADS=1 python benchmarks/reduction_checksum.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/reduction_checksum.py
    OMP_NUM_THREADS=1 python benchmarks/reduction_checksum.py --set model.layers=4 --set model.width=256

The loop is the reference trainer's step (data, forward, backward, clip, AdamW) on its
config, wrapped in DDP (gloo; alone, a one-rank group in this process; under torchrun,
every rank runs the same schedule and rank 0 prints). Two costs are measured, each with
its parts interleaved on one thread (whole-run wall-time ratios cannot resolve 0.5 % on a
shared machine):

* **checked step**: pairs of adjacent steps of the hooked model, one unchecked and one
  checked (two float64 passes over each bucket before it is sent, one after, the 16-byte
  collective beside it, and the background thread's read), in alternating order; the
  extra is the median of the pairs' differences, and the ratio at ``every`` steps is
  1 + extra / (every x step), step being the median unchecked step;
* **unchecked step**: the hook on an unchecked step is torch's default all-reduce hook
  called from Python; pairs of adjacent steps of it and of a second DDP copy with no hook
  (DDP's built-in all-reduce; ``--baseline default-hook``: torch's ``allreduce_hook``
  registered on it), alternating: the median of the pairs' ratios.

Each is printed per repeat with the median and range; the goal is <= 1.005 at the default.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from _gloo_loop import clip_of, init_gloo, reference_data, reference_step  # benchmarks/_gloo_loop.py
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from trainwatch.trainer.config import load_config
from trainwatch.rank.reduction import DEFAULT_EVERY, ReductionCheck
from trainwatch.trainer.train import Ranks, build_training_state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="reference trainer config, e.g. model.layers=8")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=100, help="pairs of steps per repeat")
    parser.add_argument("--baseline", choices=("none", "default-hook"), default="none",
                        help="the unchecked hook's comparison: DDP with no hook, or with "
                             "torch's default allreduce_hook")
    args = parser.parse_args()

    rank, world = init_gloo()
    cfg = load_config(None, args.overrides)
    ranks = Ranks(rank, rank, world, torch.device("cpu"), world > 1, 0)
    scratch = tempfile.mkdtemp(prefix="trainwatch-bench-")
    data = reference_data(cfg, scratch, rank)
    hooked_state = build_training_state(cfg, data, ranks)
    plain_state = build_training_state(cfg, data, ranks)
    hooked, plain = DDP(hooked_state.model), DDP(plain_state.model)
    if args.baseline == "default-hook":
        plain.register_comm_hook(None, allreduce_hook)
    current = [0]
    check = ReductionCheck(hooked, DEFAULT_EVERY, lambda: current[0])
    clip = clip_of(cfg)

    def step(ddp: DDP, state) -> float:
        started = time.perf_counter()
        reference_step(ddp, state, clip)
        return time.perf_counter() - started

    def checked() -> float:
        started = time.perf_counter()
        current[0] = DEFAULT_EVERY - 1  # due
        step(hooked, hooked_state)
        current[0] = 0
        verdicts = check.resolve()  # the background thread's read, counted here
        assert verdicts and not any(v.mismatch for v in verdicts), verdicts
        return time.perf_counter() - started

    for _ in range(10):
        step(hooked, hooked_state)
        step(plain, plain_state)
    checked()
    model = hooked_state.model
    params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"model: {params / 1e6:.2f}M parameters ({len(list(model.parameters()))} tensors);"
              f" {world} gloo rank(s); baseline {args.baseline}; torch threads {torch.get_num_threads()}; "
              f"load average {os.getloadavg()[0]:.1f}")
    everys = sorted({1, 10, DEFAULT_EVERY, 4 * DEFAULT_EVERY})
    per_repeat: list[tuple[float, float, float]] = []
    for repeat in range(args.repeats):
        extras, unchecked, hook_ratios = [], [], []
        for pair in range(args.pairs):
            if pair % 2:
                took = checked()
                plain_took = step(hooked, hooked_state)
            else:
                plain_took = step(hooked, hooked_state)
                took = checked()
            extras.append(took - plain_took)
            unchecked.append(plain_took)
            if pair % 2:
                no_hook = step(plain, plain_state)
                hooked_took = step(hooked, hooked_state)
            else:
                hooked_took = step(hooked, hooked_state)
                no_hook = step(plain, plain_state)
            hook_ratios.append(hooked_took / no_hook)
        s, extra = statistics.median(unchecked), statistics.median(extras)
        hook_ratio = statistics.median(hook_ratios)
        per_repeat.append((s, extra, hook_ratio))
        if rank == 0:
            print(f"repeat {repeat + 1}: step {s * 1e3:.2f} ms, checked step +{extra * 1e3:.3f} "
                  f"ms, unchecked hook {hook_ratio:.4f}, "
                  + ", ".join(f"every {n}: {1 + extra / (n * s):.5f}" for n in everys))
    if rank == 0:
        print()
        for n in everys:
            ratios = [1 + extra / (n * s) for s, extra, _ in per_repeat]
            goal = "  (default; goal <= 1.005)" if n == DEFAULT_EVERY else ""
            print(f"checked, every {n:4d} steps: median {statistics.median(ratios):.5f}, range "
                  f"{min(ratios):.5f}-{max(ratios):.5f}{goal}")
        hooks = [h for _, _, h in per_repeat]
        print(f"unchecked steps, hook / {args.baseline}: median {statistics.median(hooks):.4f}, range "
              f"{min(hooks):.4f}-{max(hooks):.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
