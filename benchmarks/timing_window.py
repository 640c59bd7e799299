"""A rank's work per timing window at world sizes 8 ... 32k: what grows with the job.

    python benchmarks/timing_window.py [--worlds 8,64,512,4096,32768] [--repeat 20] [--json]

Per window, a rank (1) in the loop, sets up the all-gather's output for every rank's
three means, and (2) in the heartbeat thread, summarizes the gathered rows into its
status (own means, the job's constant-size summary, its standing: ``_summarize_timing``).
Both are timed here on a real ``Telemetry`` fed a gathered (ranks, 3) tensor, without
the collective itself (its cost is the network's). Printed per world size: median ms
(min-max over ``--repeat``) and the ratio to 8 ranks. Goal: O(1) per rank at any world
size; what is left is linear but in C (numpy selection over the rows), not Python.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

from trainwatch.trainer.telemetry import Telemetry


def window_ms(world: int, repeat: int) -> dict:
    gen = torch.Generator().manual_seed(world)
    loop, beat = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tel = Telemetry(tmp, rank=world - 1, world_size=world, exchange_every=0)
        tel.run.create()
        for i in range(repeat):
            started = time.perf_counter()  # the loop's part, as _exchange_timings does
            out = torch.empty(world, 3, dtype=torch.float64)
            flat = out.view(-1)  # what the single-tensor all-gather is given
            loop.append((time.perf_counter() - started) * 1000)
            del flat
            out.copy_(0.09 + 0.005 * torch.rand(world, 3, generator=gen, dtype=torch.float64))
            tel._keep_window(10 * (i + 1), 10, time.time(), out)
            started = time.perf_counter()  # the heartbeat thread's part
            tel._summarize_timing()
            beat.append((time.perf_counter() - started) * 1000)
    return {"world": world, "loop_ms": statistics.median(loop), "loop_max": max(loop),
            "summarize_ms": statistics.median(beat), "summarize_min": min(beat),
            "summarize_max": max(beat)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="8,64,512,4096,32768")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [window_ms(int(w), args.repeat) for w in args.worlds.split(",")]
    base = rows[0]
    for row in rows:
        row["summarize_ratio"] = row["summarize_ms"] / base["summarize_ms"]
        row["loop_ratio"] = row["loop_ms"] / base["loop_ms"]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'world':>6} {'summarize ms':>13} {'(min-max)':>15} {'x':>6} {'loop ms':>9} {'x':>6}")
    for r in rows:
        print(f"{r['world']:>6} {r['summarize_ms']:13.3f} {r['summarize_min']:7.3f}-"
              f"{r['summarize_max']:<7.3f} {r['summarize_ratio']:6.1f} {r['loop_ms']:9.3f} "
              f"{r['loop_ratio']:6.1f}")
    print(f"(x: ratio to {base['world']} ranks; median of {args.repeat} windows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
