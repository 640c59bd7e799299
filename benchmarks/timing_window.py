"""A rank's work per timing window at world sizes 8 ... 32k: does any of it grow with the job?

    python benchmarks/timing_window.py [--worlds 8,64,512,4096,32768] [--repeat 20] [--json]

Per window, a rank (1) in the loop, builds its share of the exchange (its sketch: a
count and its value in its bin, and its two keys, ``timing_exchange.local_sketch``), and
(2) in the heartbeat thread, summarizes the summed sketch into its status (own means, the
job's constant-size summary, its standing: ``_summarize_timing``). Both are timed here
on a real ``Telemetry`` fed what the all-reduce hands every rank for that many ranks
(``sketch_of``), without the collective itself (its cost is the network's). Printed per
world size: median ms (min-max over ``--repeat``), the ratio to the first world, and the
bytes the rank hands the all-reduce. The summary's work grows with the non-empty bins
(here the ranks' 0.09-0.095 s spread: about 11 bins at any world size), at most
``SKETCH_BINS``: ``--spread`` puts one rank in each bin, the bound. The simulated
windows are built before any timing: a rank holds no list per rank.
Goal: O(1) per rank at any world size.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import tempfile
import time

import torch

from trainwatch.contract.timing import SKETCH_BINS, SKETCH_LOW, SKETCH_WIDTH
from trainwatch.rank.telemetry import Telemetry
from trainwatch.rank.timing_exchange import local_sketch, sketch_of


def window_ms(world: int, repeat: int, spread: bool) -> dict:
    gen = torch.Generator().manual_seed(world)
    windows = []  # (this rank's local seconds, what the all-reduce hands it), built first
    for _ in range(repeat):
        local = (0.09 + 0.005 * torch.rand(world, generator=gen, dtype=torch.float64)).tolist()
        if spread:  # a value in every bin (the most a summary has to walk)
            local = [SKETCH_LOW * math.exp((r % SKETCH_BINS + 0.5) * SKETCH_WIDTH)
                     for r in range(world)]
        windows.append((local[-1], sketch_of(local)))
        del local  # a rank never holds a list per rank
    gc.collect()
    loop, beat, sent = [], [], 0
    with tempfile.TemporaryDirectory() as tmp:
        tel = Telemetry(tmp, rank=world - 1, world_size=world, exchange_every=0)
        tel.run.create()
        for i, (mine, summed) in enumerate(windows):
            started = time.perf_counter()  # the loop's part, as WindowExchange.exchange does
            share = local_sketch(world - 1, mine)
            loop.append((time.perf_counter() - started) * 1000)
            sent = sum(t.numel() * t.element_size() for t in share)
            tel._keep_window(10 * (i + 1), 10, time.time(), [mine, 0.0, mine], summed)
            started = time.perf_counter()  # the heartbeat thread's part
            tel._summarize_timing()
            beat.append((time.perf_counter() - started) * 1000)
    return {"world": world, "loop_ms": statistics.median(loop), "loop_max": max(loop),
            "summarize_ms": statistics.median(beat), "summarize_min": min(beat),
            "summarize_max": max(beat), "bytes_sent": sent}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="8,64,512,4096,32768")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--spread", action="store_true",
                        help="One rank per bin: the summary's most work.")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [window_ms(int(w), args.repeat, args.spread) for w in args.worlds.split(",")]
    base = rows[0]
    for row in rows:
        row["summarize_ratio"] = row["summarize_ms"] / base["summarize_ms"]
        row["loop_ratio"] = row["loop_ms"] / base["loop_ms"]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'world':>6} {'summarize ms':>13} {'(min-max)':>15} {'x':>6} {'loop ms':>9} {'x':>6} "
          f"{'bytes':>7}")
    for r in rows:
        print(f"{r['world']:>6} {r['summarize_ms']:13.3f} {r['summarize_min']:7.3f}-"
              f"{r['summarize_max']:<7.3f} {r['summarize_ratio']:6.1f} {r['loop_ms']:9.3f} "
              f"{r['loop_ratio']:6.1f} {r['bytes_sent']:7d}")
    print(f"(x: ratio to {base['world']} ranks; median of {args.repeat} windows; bytes: what "
          "a rank hands the all-reduce)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
