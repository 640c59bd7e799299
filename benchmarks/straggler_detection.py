"""Straggler detection replayed over recorded step times: latency, hold, clearing, false flags.

    python benchmarks/straggler_detection.py [--clean-steps 10000] [--repeats 3] [--trials 20]
           [--recording tests/fixtures/step-times/NAME.json ...] [--json]
    python benchmarks/straggler_detection.py --record RUN_DIR --out FILE   # a new recording

A recording holds the per-step *local* time (outside collective phases) of every rank
of a real 4-rank gloo run on the 2-core CI VM while other work loaded it (``source``
says which): ``reference-4rank`` is tests/jobs/agent_job.py, steady steps as on a GPU node;
``cpu-oversubscribed-4rank`` is `trainwatch train` with 4 CPU-bound ranks on 2 shared
cores (load average 15-25), where one 5-step window's ratio alone varies by ~20 %.
Streams of any length are built by a block bootstrap of that recording
(blocks of 50 consecutive steps, all ranks together, so shared slowdowns stay shared),
cut into timing windows like the ranks' telemetry exchange, summarized as the ranks
publish it (read off the summed timing sketch, ``trainwatch.contract.timing.summarize``),
and fed to the agent's own ``JobStragglers`` with the default options.  For worlds of 2, 3 and 4 ranks and windows
of 5 steps and of the telemetry's default (``Telemetry(exchange_every=...)``, 10) it prints:
false flags over ``--repeats`` independent streams of clean steps (each count), and with
one rank at 0.8x speed (local time x 1.25) for 300 steps: steps until flagged, share of
the slow windows after detection that the flag stayed up, and steps until it cleared
after the rank recovered (min / median / max over the trials).  It also prints each
recording's hardest clean stretch: the highest ratio any clean rank held over 30 steps
against the median of the others, the bar a 0.8x rank (1.25) must clear within 30 steps.
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trainwatch.agent.config import STRAGGLER_DEFAULTS  # noqa: E402
from trainwatch.agent.straggler import JobStragglers  # noqa: E402
from trainwatch.contract.timing import summarize  # noqa: E402
from trainwatch.rank.telemetry import Telemetry  # noqa: E402

DEFAULT_WINDOW = inspect.signature(Telemetry).parameters["exchange_every"].default

RECORDING = REPO / "tests" / "fixtures" / "step-times" / "reference-4rank.json"
BLOCK = 50


def load(path: Path = RECORDING) -> list[list[float]]:
    """Per step, every rank's local seconds."""
    return json.loads(path.read_text())["local_seconds"]


def record(run_dir: Path, collective=("backward", "telemetry_exchange")) -> list[list[float]]:
    """Per-step local seconds of every rank from a run's metrics logs (steps all ranks have).

    Local time = step time minus the collective phases (the telemetry's default set).
    """
    per_rank: dict[int, dict[int, float]] = {}
    for path in sorted((run_dir / "metrics").glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
                phases = rec.get("phase_seconds") or {}
                local = rec["step_time_seconds"] - sum(phases.get(p, 0.0) for p in collective)
                per_rank.setdefault(int(rec["rank"]), {})[int(rec["step"])] = max(local, 1e-6)
            except (ValueError, KeyError, TypeError):
                continue
    ranks = sorted(per_rank)
    steps = sorted(set.intersection(*(set(v) for v in per_rank.values())))
    return [[round(per_rank[r][s], 6) for r in ranks] for s in steps[1:]]  # step 0 warms up


def bootstrap(recording: list[list[float]], steps: int, ranks: list[int],
              rng: random.Random) -> list[list[float]]:
    out: list[list[float]] = []
    while len(out) < steps:
        start = rng.randrange(0, max(1, len(recording) - BLOCK))
        out += [[row[r] for r in ranks] for row in recording[start:start + BLOCK]]
    return out[:steps]


def replay(stream: list[list[float]], window_steps: int, options: dict[str, Any] | None = None,
           slow: tuple[int, int, int, float] | None = None) -> list[tuple[int, dict[int, bool]]]:
    """(last step of each window, rank -> flagged) after feeding every window in order.

    ``slow`` = (rank, first step, steps, factor) multiplies that rank's local time.
    """
    tracker = JobStragglers(dict(options or STRAGGLER_DEFAULTS))
    ranks = list(range(len(stream[0])))
    out = []
    for end in range(window_steps, len(stream) + 1, window_steps):
        rows = stream[end - window_steps:end]
        means = []
        for r in ranks:
            total = 0.0
            for i, row in enumerate(rows):
                step = end - window_steps + i
                factor = slow[3] if slow and r == slow[0] and slow[1] <= step < slow[1] + slow[2] \
                    else 1.0
                total += row[r] * factor
            means.append(total / window_steps)
        # What the agent builds from the ranks' status files (trainwatch.contract.timing).
        tracker.update({"step": end - 1, "window_steps": window_steps, "time": float(end),
                        "job": summarize(means), "local": dict(enumerate(means))},
                       ranks, float(end))
        out.append((end - 1, {r: tracker.ranks[r].active for r in ranks}))
    return out


def false_flags(windows: list[tuple[int, dict[int, bool]]]) -> int:
    raised, before = 0, {}
    for _, flags in windows:
        raised += sum(1 for r, on in flags.items() if on and not before.get(r))
        before = flags
    return raised


def slow_trial(stream: list[list[float]], window_steps: int, rank: int, start: int,
               length: int = 300, factor: float = 1.25) -> dict[str, Any]:
    windows = replay(stream, window_steps, slow=(rank, start, length, factor))
    end = start + length
    detected = next((s for s, f in windows if start <= s < end and f[rank]), None)
    during = [f[rank] for s, f in windows if detected is not None and detected <= s < end]
    cleared = next((s for s, f in windows if s >= end and not f[rank]), None)
    others = sum(1 for s, f in windows for r, on in f.items() if on and r != rank)
    return {"detected_after": None if detected is None else detected - start + 1,
            "held": sum(during) / len(during) if during else 0.0,
            "cleared_after": None if cleared is None else cleared - end + 1,
            "other_ranks_flagged_windows": others}


def evaluate(recording: list[list[float]], world: int, window_steps: int, clean_steps: int,
             trials: int, seed: int = 0, repeats: int = 1) -> dict[str, Any]:
    rng = random.Random(seed)
    ranks = list(range(world))
    flags = [false_flags(replay(bootstrap(recording, clean_steps, ranks, rng), window_steps))
             for _ in range(repeats)]
    results = [slow_trial(bootstrap(recording, 1000, ranks, rng), window_steps,
                          rng.randrange(world), start=rng.randrange(200, 400))
               for _ in range(trials)]
    detected = [r["detected_after"] for r in results]
    cleared = [r["cleared_after"] for r in results]
    return {
        "world": world, "window_steps": window_steps, "clean_steps": clean_steps,
        "false_flags": sum(flags), "false_flags_each": flags,
        "trials": trials, "missed": detected.count(None),
        "detected_after_min": _min(detected), "detected_after_median": _median(detected),
        "detected_after_max": _max(detected),
        "held_min": round(min(r["held"] for r in results), 3),
        "held_median": round(statistics.median(r["held"] for r in results), 3),
        "cleared_after_min": _min(cleared), "cleared_after_median": _median(cleared),
        "cleared_after_max": _max(cleared),
        "never_cleared": cleared.count(None),
        "other_ranks_flagged": sum(r["other_ranks_flagged_windows"] > 0 for r in results),
    }


def hardest_stretch(recording: list[list[float]], steps: int = 30) -> float:
    """The highest ratio any rank's local time held over ``steps`` consecutive steps
    against the median of the other ranks' (a clean rank that looked this slow)."""
    ranks = range(len(recording[0]))
    worst = 0.0
    for start in range(len(recording) - steps + 1):
        sums = [sum(row[r] for row in recording[start:start + steps]) for r in ranks]
        for r in ranks:
            others = sorted(sums[:r] + sums[r + 1:])
            worst = max(worst, sums[r] / statistics.median(others))
    return worst


def _min(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return min(known) if known else None


def _median(values: list[int | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _max(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recording", type=Path, nargs="+",
                        default=sorted(RECORDING.parent.glob("*.json")))
    parser.add_argument("--clean-steps", type=int, default=10000)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3,
                        help="Independent streams of --clean-steps clean steps per row.")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--record", type=Path, metavar="RUN_DIR",
                        help="Build a recording from RUN_DIR's metrics logs (with --out).")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.record:
        rows = record(args.record)
        args.out.write_text(json.dumps({
            "source": f"{len(rows[0])}-rank run {args.record.name}: local seconds per step "
                      "(step time minus backward and telemetry_exchange)",
            "local_seconds": rows}, separators=(",", ":")) + "\n")
        print(f"{args.out}: {len(rows)} steps x {len(rows[0])} ranks")
        return
    everything = {}
    for path in args.recording:
        recording = load(path)
        rows = [evaluate(recording, world, w, args.clean_steps, args.trials,
                         repeats=args.repeats)
                for world in (2, 3, 4) for w in sorted({5, DEFAULT_WINDOW})]
        hardest = hardest_stretch(recording)
        everything[path.stem] = {"hardest_clean_30_steps": round(hardest, 3), "rows": rows}
        if not args.json:
            show(path, recording, rows, args.trials, hardest)
    if args.json:
        print(json.dumps(everything, indent=1))


def show(path: Path, recording: list[list[float]], rows: list[dict[str, Any]],
         trials: int, hardest: float) -> None:
    print(f"recording: {path.name}, {len(recording)} steps; 0.8x rank for 300 steps, "
          f"{trials} trials per row (min / median / max); hardest clean stretch: a rank at "
          f"{hardest:.2f}x the others' time over 30 steps (a 0.8x rank is 1.25x)")
    print("world window | false flags per clean stream | flagged after | held (min/median) | "
          "cleared after | other ranks flagged")
    for r in rows:
        each = "/".join(str(n) for n in r["false_flags_each"])
        print(f"{r['world']:>5} {r['window_steps']:>6} | {each} per {r['clean_steps']} | "
              f"{r['detected_after_min']} / {r['detected_after_median']} / "
              f"{r['detected_after_max']} steps (missed {r['missed']}) | "
              f"{r['held_min']:.0%} / {r['held_median']:.0%} | {r['cleared_after_min']} / "
              f"{r['cleared_after_median']} / {r['cleared_after_max']} steps "
              f"(never {r['never_cleared']}) | {r['other_ranks_flagged']}")


if __name__ == "__main__":
    main()
