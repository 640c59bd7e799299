"""Telemetry memory: a rank's RSS, USS and PSS with telemetry on vs off, paired.

    python benchmarks/telemetry_memory.py [--pairs 3] [--steps 1000] [--pending]

Each run is its own process: the plain loop of ``telemetry_whole.py`` (an MLP, ~10 ms
steps on one CPU core), ``--steps`` steps, then its memory read with psutil (whole
process RSS; USS, the pages only it holds; PSS, shared pages split among their users)
and its peak (VmHWM). On and off alternate in order. ``--pending`` never flushes (a
heartbeat interval of an hour): every step stays pending until the end, which shows
what a pending step holds whatever the machine's speed. Printed per measure: median
on - off in MiB, with the range over the pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def child(steps: int, run_dir: str, enabled: bool, interval: float) -> None:
    import psutil

    from telemetry_whole import plain_model, plain_steps
    from trainwatch.rank.telemetry import Telemetry

    model, opt = plain_model()
    tel = Telemetry(run_dir, enabled=enabled, heartbeat_interval=interval,
                    max_pending=max(1000, steps)).start()
    plain_steps(tel, model, opt, steps)
    m = psutil.Process().memory_full_info()
    hwm = [line for line in Path("/proc/self/status").read_text().splitlines()
           if line.startswith("VmHWM")]
    print(json.dumps({"rss": m.rss, "uss": m.uss, "pss": m.pss,
                      "peak": int(hwm[0].split()[1]) * 1024}))
    tel.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--pending", action="store_true", help="never flush until the end")
    parser.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    interval = 3600.0 if args.pending else 1.0
    if args.child:
        child(args.steps, args.run_dir, args.child == "on", interval)
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="tw-telemetry-memory-") as tmp:
        for i in range(args.pairs):
            got = {}
            for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
                cmd = [sys.executable, __file__, "--child", mode, "--steps", str(args.steps),
                       "--run-dir", os.path.join(tmp, f"{i}-{mode}"),
                       *(["--pending"] if args.pending else [])]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
                got[mode] = json.loads(out.stdout.splitlines()[-1])
            rows.append(got)
    print(f"{args.pairs} pairs of {args.steps} steps, "
          f"{'every step pending until the end' if args.pending else 'a beat a second'}:")
    for key in ("rss", "uss", "pss", "peak"):
        diff = sorted((r["on"][key] - r["off"][key]) / 2**20 for r in rows)
        off = statistics.median(r["off"][key] for r in rows) / 2**20
        print(f"  {key:5} on - off: {statistics.median(diff):+7.1f} MiB "
              f"({diff[0]:+.1f} to {diff[-1]:+.1f}); off {off:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
