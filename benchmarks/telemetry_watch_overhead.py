"""Step time of one loop three ways: telemetry off / with-blocks / ``tel.watch`` hooks.

    OMP_NUM_THREADS=1 python benchmarks/telemetry_watch_overhead.py
    torchrun --standalone --nproc-per-node 2 benchmarks/telemetry_watch_overhead.py

The loop is the reference trainer's step (data, forward, backward, clip, optimizer) on its
default config. Blocks of ``--block`` steps rotate between the three modes (the order
shifts every round, so no mode always follows another); the watch hooks are on the model
and optimizer only during watch blocks. Each repeat gives the median step time per mode
and the ratios to "off"; printed are every repeat's ratios, their median and range, with
the goal <= 1.005 for both. Then the telemetry work alone: loop-thread CPU time per step
of each mode with a one-weight model (blocks of steps rotating), which machine load moves
least, as a share of the real loop's median step.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import tempfile
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from trainwatch.trainer.config import load_config
from trainwatch.trainer.data import ensure_default_dataset, load_dataset
from trainwatch.rank.telemetry import Telemetry
from trainwatch.trainer.train import autocast, build_training_state, setup_process_group

MODES = ("off", "blocks", "watch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="measured steps per mode, per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block", type=int, default=10, help="steps in a row of one mode")
    parser.add_argument("--warmup-steps", type=int, default=100)
    args = parser.parse_args()

    cfg = load_config(None, [])
    ranks = setup_process_group(cfg)
    scratch = tempfile.mkdtemp(prefix="trainwatch-bench-")
    data_dir = os.path.join(scratch, f"data-{ranks.rank}")
    ensure_default_dataset(data_dir, size_bytes=cfg.data.corpus_bytes, seed=cfg.data.corpus_seed,
                           val_fraction=cfg.data.val_fraction)
    state = build_training_state(cfg, load_dataset(data_dir), ranks)
    model = state.model
    ddp = DDP(model) if ranks.distributed else model
    clip = cfg.optim.grad_clip or math.inf
    tokens = cfg.train.batch_size * cfg.model.context
    cuda = ranks.device.type == "cuda"

    def telemetry(name: str, enabled: bool = True) -> Telemetry:
        return Telemetry(os.path.join(scratch, name), rank=ranks.rank,
                         local_rank=ranks.local_rank, world_size=ranks.world_size,
                         device=ranks.device, enabled=enabled,
                         flops_per_token=model.flops_per_token()).start()

    tels = {"off": telemetry("off", enabled=False), "blocks": telemetry("blocks"),
            "watch": telemetry("watch")}

    def optimizer_part() -> torch.Tensor:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        state.optimizer.step()
        state.scheduler.step()
        state.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def step_blocks(tel: Telemetry, n: int) -> None:
        with tel.step(n) as record:
            with tel.phase("data"):
                x, y = (t.to(ranks.device, non_blocking=True) for t in next(state.loader))
            with tel.phase("forward"), autocast(ranks.device):
                _, loss = ddp(x, y)
            with tel.phase("backward"):
                loss.backward()
            with tel.phase("optimizer"):
                grad_norm = optimizer_part()
            record.record(loss=loss.detach(), grad_norm=grad_norm, tokens=tokens,
                          samples=cfg.train.batch_size)

    def step_watch(tel: Telemetry, n: int) -> None:
        with tel.phase("data"):
            x, y = (t.to(ranks.device, non_blocking=True) for t in next(state.loader))
        with autocast(ranks.device):
            _, loss = ddp(x, y)
        loss.backward()
        grad_norm = optimizer_part()
        tel.record(loss=loss.detach(), grad_norm=grad_norm, tokens=tokens,
                   samples=cfg.train.batch_size)

    def bookkeeping(blocks: int = 30, block: int = 200) -> dict[str, float]:
        """Loop-thread CPU seconds per step with a one-weight model, per mode, in rotating
        blocks: the telemetry calls and hooks plus a constant, the part load moves least."""
        tiny = torch.nn.Linear(1, 1)
        opt = torch.optim.SGD(tiny.parameters(), lr=0.0)
        x = torch.ones(1, 1)
        cpu = {m: 0.0 for m in MODES}
        bare = {"off": telemetry("bare-off", enabled=False), "blocks": telemetry("bare-blocks"),
                "watch": telemetry("bare-watch")}
        for tel in bare.values():
            tel.heartbeat_interval = 3600
        for b in range(blocks * 3):
            mode = MODES[(b + b // 3) % 3]
            tel = bare[mode]
            handle = tel.watch(tiny, opt) if mode == "watch" else None
            started = time.thread_time()
            for n in range(block):
                if mode == "watch":
                    with tel.phase("data"):
                        pass
                    loss = tiny(x).sum()
                    loss.backward()
                    opt.step()
                    tel.record(loss=loss, tokens=tokens, samples=1)
                else:
                    with tel.step(n) as record:
                        with tel.phase("data"):
                            pass
                        with tel.phase("forward"):
                            loss = tiny(x).sum()
                        with tel.phase("backward"):
                            loss.backward()
                        with tel.phase("optimizer"):
                            opt.step()
                        record.record(loss=loss, tokens=tokens, samples=1)
            cpu[mode] += time.thread_time() - started
            if handle is not None:
                handle.remove()
        for tel in bare.values():
            tel.close()
        return {m: cpu[m] / (blocks * block) for m in MODES}

    for n in range(args.warmup_steps):
        step_blocks(tels["off"], n)
    ratios: dict[str, list[float]] = {"blocks": [], "watch": []}
    medians: list[dict[str, float]] = []
    counter = {m: 0 for m in MODES}
    for _ in range(args.repeats):
        times: dict[str, list[float]] = {m: [] for m in MODES}
        rounds = args.steps // args.block
        for r in range(rounds):
            order = MODES[r % 3:] + MODES[:r % 3]
            for mode in order:
                tel = tels[mode]
                handle = tel.watch(ddp, state.optimizer, first_step=counter[mode]) \
                    if mode == "watch" else None
                for _ in range(args.block):
                    started = time.perf_counter()
                    if mode == "watch":
                        step_watch(tel, counter[mode])
                    else:
                        step_blocks(tel, counter[mode])
                    if cuda:
                        torch.cuda.synchronize()
                    times[mode].append(time.perf_counter() - started)
                    counter[mode] += 1
                if handle is not None:
                    handle.remove()
        median = {m: statistics.median(times[m]) for m in MODES}
        medians.append(median)
        for mode in ratios:
            ratios[mode].append(median[mode] / median["off"])
    for tel in tels.values():
        tel.close()
    alone = bookkeeping()

    if ranks.rank == 0:
        device = torch.cuda.get_device_name(ranks.device) if cuda else "cpu"
        print(f"device {device}, world size {ranks.world_size}, {model.num_params():,} params, "
              f"{args.repeats} repeats x {args.steps} steps per mode, blocks of {args.block}, "
              "rotating")
        for i, median in enumerate(medians):
            print(f"repeat {i}: median step off {median['off'] * 1e3:.3f} ms, with-blocks "
                  f"{median['blocks'] * 1e3:.3f} ms, watch {median['watch'] * 1e3:.3f} ms")
        for mode, label in (("blocks", "with-blocks / off"), ("watch", "watch hooks / off")):
            values = ratios[mode]
            print(f"{label}: median {statistics.median(values):.4f}, range "
                  f"{min(values):.4f}-{max(values):.4f}  (goal <= 1.005)")
        off_step = statistics.median(m["off"] for m in medians)
        for mode, label in (("blocks", "with-blocks"), ("watch", "watch hooks")):
            extra = alone[mode] - alone["off"]
            print(f"{label} work alone (loop-thread CPU, one-weight model): {extra * 1e6:+.1f} us "
                  f"per step over off ({alone['off'] * 1e6:.1f} us); as a share of the median "
                  f"step off: {1 + extra / off_step:.4f}")
    shutil.rmtree(scratch, ignore_errors=True)
    if ranks.distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
