"""Readers at scale: peak memory and time of `trainwatch report`, `drill score` and
`diagnose` on a run of many steps, against a plain JSON parse of the same files.

    python benchmarks/report_scale.py [--steps 300000[,1000000]] [--shape plain,saves,busy]
        [--baseline SRC] [--repeat 3] [--json]

Writes a synthetic run directory per step count: rank 0's metrics log as the telemetry
writes it (one line per step, ~400 bytes), a journal with two restarts (one resumed from
an older checkpoint, so steps are recomputed), a save every 1,000 steps (journaled as the
Checkpointer does: the save, then the pruning of the oldest of the three kept) and an
evaluation every 5,000. ``--shape saves`` saves every 100 steps. ``--shape busy`` writes
a busier run of the same length: an evaluation every 50 steps and 200 restarts (each resumed from the last save). Each
reader runs as its own process; its peak RSS (VmHWM), wall time and CPU time are measured
alongside a process that only reads and `json.loads` every line of the same files (the
least any reader must do), in alternation, ``--repeat`` times.
Goals (issue #38): for every shape, peak memory flat in the number of steps and <= 150
MiB at 1M steps, CPU time <= 1.3x the plain parse; printed with the spread, met or not,
and how the peak grows a step between the fewest and the most steps given.
``--baseline SRC`` also runs the report of another source tree, alternating.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PLAIN_PARSE = r"""
import json, sys
n = 0
for path in sys.argv[1:]:
    with open(path, "rb") as fh:
        for line in fh:
            json.loads(line)
            n += 1
print(n)
"""

# Runs a reader in-process and reports its own peak RSS (VmHWM) on stderr's last line.
WRAP = r"""
import sys, runpy
from pathlib import Path
argv = sys.argv[1:]
sys.argv = ["trainwatch", *argv]
code = 0
try:
    runpy.run_module("trainwatch", run_name="__main__")
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else 0
hwm = [l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM")]
print("HWM", int(hwm[0].split()[1]) * 1024, file=sys.stderr)
sys.exit(code)
"""

PARSE_WRAP = PLAIN_PARSE + r"""
from pathlib import Path
hwm = [l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM")]
print("HWM", int(hwm[0].split()[1]) * 1024, file=sys.stderr)
"""


SHAPES = {"plain": {"eval_every": 5000, "restarts": 2, "save_every": 1000},
          "saves": {"eval_every": 5000, "restarts": 2, "save_every": 100},
          "busy": {"eval_every": 50, "restarts": 200, "save_every": 1000}}


def attempts(steps: int, restarts: int) -> list[tuple[int, int, int]]:
    """(attempt, first step, step it crashed at or the end) of each attempt."""
    if restarts == 2:  # the plain shape: the first resume is from an older save
        crash1, crash2 = int(steps * 0.4), int(steps * 0.75)
        resume1, resume2 = crash1 - crash1 % 1000 - 1000, crash2 - crash2 % 1000
        return [(0, 0, crash1), (1, resume1, crash2), (2, resume2, steps)]
    crashes = [steps * (i + 1) // (restarts + 1) + 377 for i in range(restarts)]
    firsts = [0, *(crash - crash % 1000 for crash in crashes)]
    return list(zip(range(restarts + 1), firsts, [*crashes, steps]))


def make_run(root: Path, steps: int, eval_every: int = 5000, restarts: int = 2,
             save_every: int = 1000) -> Path:
    """A run of ``steps`` completed steps (see the module docstring)."""
    run = root / f"run-{steps}-{eval_every}-{restarts}-{save_every}"
    for d in ("status", "metrics", "checkpoints", "logs", "control", "diagnostics", "tmp"):
        (run / d).mkdir(parents=True, exist_ok=True)
    t0 = 1_800_000_000.0
    step_s = 0.1
    (run / "run.json").write_text(json.dumps({
        "format": "trainwatch.run", "version": 1, "job": "scale", "created_at": t0,
        "world_size": 2, "nproc_per_node": 2, "config": {"train": {"steps": steps}}}))
    journal = [{"v": 1, "time": t0, "event": "launcher_started", "source": "launcher",
                "host": "n0", "pid": 1}]
    plan = attempts(steps, restarts)
    t = t0 + 5.0
    with open(run / "metrics" / "rank-00000.jsonl", "w") as metrics:
        for attempt, first, stop in plan:
            for rank in (0, 1):
                journal.append({"v": 1, "time": t, "event": "rank_started",
                                "source": f"rank{rank}", "host": "n0", "rank": rank,
                                "pid": 100 + 10 * attempt + rank, "restart_count": attempt})
            if attempt:
                journal.append({"v": 1, "time": t + 0.5, "event": "checkpoint_resumed",
                                "source": "rank0", "host": "n0", "rank": 0, "step": first})
            t += 3.0
            lines = []
            for step in range(first, stop):
                t += step_s
                lines.append(json.dumps({
                    "v": 1, "kind": "step", "step": step, "time": t, "rank": 0,
                    "step_time_seconds": step_s - 0.0003,
                    "phase_seconds": {"data": 0.0002, "forward": 0.03, "backward": 0.05,
                                      "optimizer": 0.012},
                    "data_wait_seconds": 0.0002, "loss": 3.2, "grad_norm": 0.9, "lr": 3e-4,
                    "tokens": 4096, "samples": 16, "tokens_per_second": 41000.0,
                    "samples_per_second": 160.0, "mfu": None, "memory_bytes": 321716224,
                    "memory_kind": "rss"}, separators=(",", ":")))
                if (step + 1) % save_every == 0:
                    save = step + 1  # as the Checkpointer journals a save and its pruning
                    journal.append({"v": 1, "time": t + 0.05, "event": "checkpoint_saved",
                                    "source": "rank0", "host": "n0", "rank": 0,
                                    "step": save, "path": f"{run}/checkpoints/step-{save:09d}",
                                    "bytes": 289_012_345, "blocking_seconds": 0.02,
                                    "write_seconds": 0.3, "waited_seconds": 0.0,
                                    "mode": "async", "reason": "interval",
                                    "metrics": {"loss": 3.2}})
                    if save > 3 * save_every:
                        journal.append({"v": 1, "time": t + 0.06, "event": "checkpoint_pruned",
                                        "source": "rank0", "host": "n0", "rank": 0,
                                        "step": save - 3 * save_every, "reason": "keep_last",
                                        "path": f"{run}/checkpoints/step-"
                                                f"{save - 3 * save_every:09d}", "removed": True})
                    t += 0.02
                if (step + 1) % eval_every == 0:
                    t += 1.0
                    lines.append(json.dumps({"v": 1, "kind": "eval", "step": step, "time": t,
                                             "rank": 0, "val_loss": 3.0}))
                if len(lines) >= 10000:
                    metrics.write("\n".join(lines) + "\n")
                    lines = []
            if lines:
                metrics.write("\n".join(lines) + "\n")
            if stop < steps:
                journal.append({"v": 1, "time": t + 1.0, "event": "failed", "source": "rank1",
                                "host": "n0", "rank": 1, "error": "RuntimeError('boom')"})
                journal.append({"v": 1, "time": t + 2.0, "event": "restarted",
                                "source": "launcher", "host": "n0"})
                t += 20.0
    journal.append({"v": 1, "time": t + 0.5, "event": "finished", "source": "rank0",
                    "host": "n0", "rank": 0})
    journal.append({"v": 1, "time": t + 1.0, "event": "launcher_exited", "source": "launcher",
                    "host": "n0", "pid": 1, "returncode": 0})
    journal.sort(key=lambda e: e["time"])
    (run / "journal.jsonl").write_text("".join(json.dumps(e) + "\n" for e in journal))
    for rank in (0, 1):
        (run / "status" / f"rank-{rank:05d}.json").write_text(json.dumps({
            "format": "trainwatch.status", "version": 1, "job": "scale", "rank": rank,
            "world_size": 2, "state": "finished", "step": steps - 1, "pid": 999_999_999}))
    (run / "drill").mkdir(exist_ok=True)  # what `trainwatch drill run` leaves, to re-score
    (run / "drill" / "drill.json").write_text(json.dumps({
        "format": "trainwatch.drill.record", "version": 1, "drill": "rank-killed",
        "exit_code": 0, "started_at": t0, "ended_at": t + 1.0, "settings": {}}))
    return run


def measure(cmd: list[str], env: dict | None = None,
            cwd: str | None = None) -> tuple[float, float, int, int]:
    """(wall seconds, CPU seconds, peak RSS bytes, exit code) of one process. CPU time
    moves far less than wall time when other work shares the machine."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env=env, cwd=cwd)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    hwm = [line for line in proc.stderr.splitlines() if line.startswith("HWM ")]
    if not hwm:
        raise SystemExit(f"{cmd}: no peak RSS reported (exit {proc.returncode}):\n"
                         f"{proc.stderr[-2000:]}")
    return wall, cpu, int(hwm[-1].split()[1]), proc.returncode


GOALS = {"report_peak_mib_at_1m": 150, "report_cpu_ratio": 1.3}


def measure_run(run: Path, readers: list[str], repeat: int, baseline: str | None) -> dict:
    """Every reader and the plain parse on one run, alternating, ``repeat`` times; with
    ``baseline`` (a source tree), also ``report_before``: the report of that tree."""
    files = [str(run / "journal.jsonl"), str(run / "metrics" / "rank-00000.jsonl")]
    commands = {
        "plain_parse": [sys.executable, "-c", PARSE_WRAP, *files],
        "report": [sys.executable, "-c", WRAP, "report", str(run), "--json"],
        "report_before": [sys.executable, "-c", WRAP, "report", str(run), "--json"],
        "drill": [sys.executable, "-c", WRAP, "drill", "score", str(run), "--json"],
        "diagnose": [sys.executable, "-c", WRAP, "diagnose", "--run-dir", str(run), "--json"],
    }
    names = ["plain_parse", *readers, *(["report_before"] if baseline else [])]
    # ``python -c`` puts its working directory first on sys.path: the baseline runs in its
    # own tree, so a checkout's package in the current directory cannot stand in for it
    envs = {"report_before": {**os.environ, "PYTHONPATH": str(baseline)}}
    cwds = {"report_before": str(baseline)}
    samples: dict[str, list[tuple[float, float, int]]] = {k: [] for k in names}
    for _ in range(repeat):  # alternate, so load hits every reader alike
        for name in names:
            wall, cpu, rss, _code = measure(commands[name], envs.get(name), cwds.get(name))
            samples[name].append((wall, cpu, rss))
    row: dict = {"bytes": sum(os.path.getsize(f) for f in files),
                 "load_average_1m": os.getloadavg()[0]}
    base = samples["plain_parse"]
    base_wall = statistics.median(w for w, _, _ in base)
    base_rss = statistics.median(r for _, _, r in base)
    for name in names:
        walls = [w for w, _, _ in samples[name]]
        rsss = [r for _, _, r in samples[name]]
        # Each run against the plain parse run next to it: the ratio's spread.
        cpu = sorted(c / b[1] for (_, c, _), b in zip(samples[name], base))
        row[name] = {"wall_s": statistics.median(walls), "wall_min": min(walls),
                     "wall_max": max(walls), "peak_rss_mib": max(rsss) / 2**20,
                     "wall_ratio": statistics.median(walls) / base_wall,
                     "cpu_s": statistics.median(c for _, c, _ in samples[name]),
                     "cpu_ratio": statistics.median(cpu),
                     "cpu_ratio_range": [cpu[0], cpu[-1]],
                     "rss_ratio": max(rsss) / base_rss}
    return row


def growth(rows: list[dict], name: str) -> float | None:
    """Bytes of peak memory per step between the fewest and the most steps measured."""
    if len(rows) < 2 or name not in rows[0]:
        return None
    first, last = rows[0], rows[-1]
    return ((last[name]["peak_rss_mib"] - first[name]["peak_rss_mib"]) * 2**20
            / (last["steps"] - first["steps"]))


def verdict(row: dict, name: str = "report") -> str:
    r = row[name]
    ok_cpu = r["cpu_ratio"] <= GOALS["report_cpu_ratio"]
    ok_rss = row["steps"] < 1_000_000 or r["peak_rss_mib"] <= GOALS["report_peak_mib_at_1m"]
    return "met" if ok_cpu and ok_rss else "NOT MET"


def show(out: dict, repeat: int) -> None:
    for shape, rows in out["shapes"].items():
        spec = SHAPES[shape]
        for row in rows:
            print(f"{row['steps']} steps, {shape} shape (an evaluation every "
                  f"{spec['eval_every']} steps, a save every {spec['save_every']}, "
                  f"{spec['restarts']} restarts; {row['bytes'] / 2**20:.0f} MiB of JSON lines), "
                  f"median of {repeat} alternating runs, load average "
                  f"{row['load_average_1m']:.1f}:")
            print(f"  {'reader':13} {'wall s':>8} {'(min-max)':>14} {'x parse':>8} "
                  f"{'CPU s':>7} {'x parse (min-max)':>19} {'peak RSS MiB':>13} {'x parse':>8}")
            for name in [k for k in row if isinstance(row[k], dict)]:
                r = row[name]
                low, high = r["cpu_ratio_range"]
                print(f"  {name:13} {r['wall_s']:8.2f} {r['wall_min']:6.2f}-{r['wall_max']:<7.2f}"
                      f" {r['wall_ratio']:8.2f} {r['cpu_s']:7.2f} {r['cpu_ratio']:6.2f} "
                      f"({low:.2f}-{high:.2f}) {r['peak_rss_mib']:13.1f} {r['rss_ratio']:8.2f}")
            print(f"  report: {verdict(row)} (goals: CPU <= {GOALS['report_cpu_ratio']}x the "
                  f"plain parse; peak <= {GOALS['report_peak_mib_at_1m']} MiB at 1M steps)")
        for name in ("report", "report_before", "drill", "diagnose"):
            grown = growth(rows, name)
            if grown is not None:
                print(f"  {shape}: {name} peak grows {grown:.1f} bytes a step "
                      f"({rows[0]['steps']} -> {rows[-1]['steps']} steps)")
    print(f"(load average {out['load_average_1m_start']:.1f} at start, "
          f"{out['load_average_1m_end']:.1f} at end; CPU time is compared, each run against "
          "the plain parse run next to it)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default="300000", help="step counts, a comma list")
    parser.add_argument("--shape", default="plain",
                        help=f"run shapes, a comma list of {', '.join(SHAPES)}")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--readers", default="report,drill,diagnose")
    parser.add_argument("--baseline", metavar="SRC",
                        help="also run the report of this source tree (e.g. a worktree of "
                             "the code before), alternating with the rest")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    shapes = [s for s in args.shape.split(",") if s]
    if unknown := [s for s in shapes if s not in SHAPES]:
        parser.error(f"--shape: unknown {', '.join(unknown)} (one of {', '.join(SHAPES)})")
    readers = [r for r in args.readers.split(",") if r]
    out: dict = {"load_average_1m_start": os.getloadavg()[0], "goals": GOALS, "shapes": {}}
    with tempfile.TemporaryDirectory(prefix="tw-report-scale-") as tmp:
        for shape in shapes:
            rows = out["shapes"][shape] = []
            for steps in sorted(int(s) for s in args.steps.split(",")):
                run = make_run(Path(tmp), steps, **SHAPES[shape])
                rows.append({"steps": steps, **measure_run(run, readers, args.repeat,
                                                           args.baseline)})
                shutil.rmtree(run)
            out.setdefault("growth_bytes_per_step", {})[shape] = {
                name: growth(rows, name) for name in ("report", "report_before", *readers)}
    out["load_average_1m_end"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        show(out, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
