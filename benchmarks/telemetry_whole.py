"""Telemetry overhead the way a user sees it: the same whole training process with
telemetry on and off, paired and repeated, wall time and CPU time, as ratios.

    python benchmarks/telemetry_whole.py [--pairs 5] [--steps 1000] [--json]
        [--which trainer,plain]

Two trainings, each run as separate processes, on/off in pairs whose order alternates
(so drift in machine load hits both sides):

* ``trainer``: the reference trainer (``trainwatch train --nproc-per-node 1``, torchrun
  included) on its default model, ``--steps`` steps, no checkpoints, no evaluation, no
  milestones; only ``telemetry.enabled`` differs;
* ``plain``: a plain torch loop (an MLP, ~10 ms steps on one CPU core) instrumented as in
  the README, with ``Telemetry(enabled=...)`` the only difference.

Wall time is the process tree's, from start to exit; CPU time is user + system of the
whole tree (``RUSAGE_CHILDREN``). Printed per training: the median of the per-pair
ratios on/off with their range, and the extra milliseconds per step. Goal: <= 1.005 for
both wall and CPU. ``OMP_NUM_THREADS`` is 1 on both sides (a shared 2-core machine).

With ``--control`` every pair is followed by an A/A pair (telemetry off on both sides):
the spread of ratios between identical runs is this machine's resolution, and an on/off
ratio inside it shows nothing either way.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def plain_model():
    """The plain loop's model and optimizer, the same in every telemetry benchmark."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 256))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def plain_steps(tel, model, opt, steps: int) -> None:
    """The plain loop's steps, each phase timed by ``tel``."""
    import torch

    for step in range(steps):
        with tel.step(step) as s:
            with tel.phase("data"):
                x = torch.randn(128, 256)
            with tel.phase("forward"):
                loss = torch.nn.functional.mse_loss(model(x), x)
            with tel.phase("backward"):
                opt.zero_grad()
                loss.backward()
            with tel.phase("optimizer"):
                opt.step()
            s.record(loss=loss, lr=0.01, samples=x.shape[0])


def plain_child(steps: int, run_dir: str, enabled: bool) -> None:
    """The plain loop (run in a child process)."""
    from trainwatch.rank.telemetry import Telemetry

    model, opt = plain_model()
    tel = Telemetry(run_dir, enabled=enabled).start()
    plain_steps(tel, model, opt, steps)
    tel.close()


def command(which: str, enabled: bool, steps: int, run_dir: Path, data_dir: Path) -> list[str]:
    if which == "plain":
        return [sys.executable, __file__, "--child", "plain", "--steps", str(steps),
                "--run-dir", str(run_dir), "--telemetry", "on" if enabled else "off"]
    return [sys.executable, "-m", "trainwatch", "train", "--nproc-per-node", "1",
            "--run-dir", str(run_dir), "--steps", str(steps), "--max-restarts", "0",
            "--set", f"telemetry.enabled={'true' if enabled else 'false'}",
            "--set", "checkpoint.enabled=false", "--set", "train.eval_interval=0",
            "--set", "train.milestone_interval=0", "--set", f"data.path={data_dir}"]


def run_once(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the whole process tree)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def measure(which: str, pairs: int, steps: int, tmp: Path, data_dir: Path,
            control: bool = False) -> dict:
    rows, same = [], []
    for i in range(pairs):
        got = {}
        for enabled in ((True, False) if i % 2 else (False, True)):
            run_dir = tmp / f"{which}-{i}-{'on' if enabled else 'off'}"
            got[enabled] = run_once(command(which, enabled, steps, run_dir, data_dir))
        rows.append({"on": got[True], "off": got[False]})
        if control:
            a, b = (run_once(command(which, False, steps, tmp / f"{which}-{i}-aa{k}", data_dir))
                    for k in (0, 1))
            same.append((a[0] / b[0], a[1] / b[1]))
    wall = sorted(r["on"][0] / r["off"][0] for r in rows)
    cpu = sorted(r["on"][1] / r["off"][1] for r in rows)
    resolution = {}
    if same:
        resolution = {"aa_wall_ratio_range": [min(w for w, _ in same), max(w for w, _ in same)],
                      "aa_cpu_ratio_range": [min(c for _, c in same), max(c for _, c in same)]}
    extra_ms = sorted((r["on"][0] - r["off"][0]) / steps * 1000 for r in rows)
    extra_cpu_ms = sorted((r["on"][1] - r["off"][1]) / steps * 1000 for r in rows)
    return {"pairs": pairs, "steps": steps,
            "wall_ratio": statistics.median(wall), "wall_ratio_range": [wall[0], wall[-1]],
            "cpu_ratio": statistics.median(cpu), "cpu_ratio_range": [cpu[0], cpu[-1]],
            "extra_wall_ms_per_step": statistics.median(extra_ms),
            "extra_cpu_ms_per_step": statistics.median(extra_cpu_ms),
            "off_wall_s": statistics.median(r["off"][0] for r in rows),
            "off_cpu_s": statistics.median(r["off"][1] for r in rows),
            **resolution, "runs": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--which", default="trainer,plain")
    parser.add_argument("--control", action="store_true",
                        help="also run an A/A pair (off/off) after each pair: the resolution")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--telemetry", choices=("on", "off"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "plain":
        plain_child(args.steps, args.run_dir, args.telemetry == "on")
        return 0
    out: dict = {"load_average_1m_start": os.getloadavg()[0], "results": {}}
    with tempfile.TemporaryDirectory(prefix="tw-telemetry-whole-") as tmp_name:
        tmp = Path(tmp_name)
        data_dir = tmp / "data"
        if "trainer" in args.which:
            subprocess.run([sys.executable, "-m", "trainwatch", "data", "prepare", "--out",
                            str(data_dir)], check=True, stdout=subprocess.DEVNULL)
        for which in [w for w in args.which.split(",") if w]:
            out["results"][which] = measure(which, args.pairs, args.steps, tmp, data_dir,
                                            args.control)
    out["load_average_1m_end"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"telemetry on / off, whole process, {args.pairs} pairs of {args.steps} steps "
          f"(load average {out['load_average_1m_start']:.1f} -> "
          f"{out['load_average_1m_end']:.1f}; goal <= 1.005)")
    for which, r in out["results"].items():
        print(f"  {which:8} wall {r['wall_ratio']:.4f} ({r['wall_ratio_range'][0]:.4f}-"
              f"{r['wall_ratio_range'][1]:.4f})  CPU {r['cpu_ratio']:.4f} "
              f"({r['cpu_ratio_range'][0]:.4f}-{r['cpu_ratio_range'][1]:.4f})  "
              f"+{r['extra_wall_ms_per_step']:.3f} ms wall, +{r['extra_cpu_ms_per_step']:.3f} "
              f"ms CPU per step; off: {r['off_wall_s']:.1f} s wall, {r['off_cpu_s']:.1f} s CPU")
        if "aa_wall_ratio_range" in r:
            (wl, wh), (cl, ch) = r["aa_wall_ratio_range"], r["aa_cpu_ratio_range"]
            print(f"  {'':8} A/A (off/off, the resolution): wall {wl:.4f}-{wh:.4f}  "
                  f"CPU {cl:.4f}-{ch:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
