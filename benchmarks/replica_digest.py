"""Overhead of the replica digest (``Telemetry.check_replicas``) as a ratio of step time.

    OMP_NUM_THREADS=1 python benchmarks/replica_digest.py
    OMP_NUM_THREADS=1 python benchmarks/replica_digest.py --set model.layers=8 --set model.width=512

The loop is the reference trainer's step (data, forward, backward, clip, AdamW) on its
config (``--set`` overrides it). Wall-time ratios of whole runs cannot resolve 0.5 % on a
shared machine, so each repeat measures the two parts on the same thread, interleaved:
a block of steps (median step time), then a digest of the parameters as the loop takes it
plus the background read (median of its times), alternating until both have enough
samples. The ratio at ``every`` steps between digests is 1 + digest / (every x step); it is
printed per repeat with the median and range, for the default ``every`` and a few others,
with the goal <= 1.005 at the default.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time

import torch

from trainwatch.trainer.config import load_config
from trainwatch.trainer.data import ensure_default_dataset, load_dataset
from trainwatch.rank.replicas import DEFAULT_EVERY, ReplicaCheck
from trainwatch.trainer.train import Ranks, build_training_state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="reference trainer config, e.g. model.layers=8")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=20, help="step blocks + digests per repeat")
    parser.add_argument("--block", type=int, default=5, help="steps between two timed digests")
    parser.add_argument("--optimizer-state", action="store_true",
                        help="digest AdamW's state too (three times the tensors)")
    args = parser.parse_args()

    cfg = load_config(None, args.overrides)
    ranks = Ranks(0, 0, 1, torch.device("cpu"), False, 0)
    scratch = tempfile.mkdtemp(prefix="trainwatch-bench-")
    data_dir = os.path.join(scratch, "data")
    ensure_default_dataset(data_dir, size_bytes=cfg.data.corpus_bytes, seed=cfg.data.corpus_seed,
                           val_fraction=cfg.data.val_fraction)
    state = build_training_state(cfg, load_dataset(data_dir), ranks)
    model = state.model
    clip = cfg.optim.grad_clip or math.inf
    check = ReplicaCheck(model, optimizer=state.optimizer if args.optimizer_state else None)

    def step() -> None:
        x, y = next(state.loader)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        state.optimizer.step()
        state.scheduler.step()
        state.optimizer.zero_grad(set_to_none=True)

    def digest() -> None:
        check.take(0)
        check.resolve()

    for _ in range(10):
        step()
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters ({len(list(model.parameters()))} tensors)"
          f"{', with AdamW state' if args.optimizer_state else ''}; torch threads "
          f"{torch.get_num_threads()}")
    everys = sorted({1, 10, DEFAULT_EVERY, 4 * DEFAULT_EVERY})
    per_repeat: list[tuple[float, float]] = []
    for repeat in range(args.repeats):
        steps, digests = [], []
        for _ in range(args.rounds):
            for _ in range(args.block):
                started = time.perf_counter()
                step()
                steps.append(time.perf_counter() - started)
            started = time.perf_counter()
            digest()
            digests.append(time.perf_counter() - started)
        s, d = statistics.median(steps), statistics.median(digests)
        per_repeat.append((s, d))
        print(f"repeat {repeat + 1}: step {s * 1e3:.2f} ms, digest {d * 1e3:.3f} ms, "
              + ", ".join(f"every {n}: {1 + d / (n * s):.5f}" for n in everys))
    print()
    for n in everys:
        ratios = [1 + d / (n * s) for s, d in per_repeat]
        goal = "  (default; goal <= 1.005)" if n == DEFAULT_EVERY else ""
        print(f"every {n:4d} steps: median {statistics.median(ratios):.5f}, range "
              f"{min(ratios):.5f}-{max(ratios):.5f}{goal}")


if __name__ == "__main__":
    main()
