"""Stall to first resumed step, with default settings: where the time goes.

    python benchmarks/stall_recovery.py [--nproc 2] [--repeats 1] [--json]

Starts ``trainwatch run --nproc-per-node N`` on a fresh run directory with every setting
at its default (agent, alert rules, controller, trainer), waits for the ranks to train,
freezes one rank with SIGSTOP (a wedged process: it keeps its sockets, so the others
wait in the collective) and times, from the SIGSTOP:

* detect: the agent's stall finding (``detected_at``, polled from its ``/status``);
* alert: the ``TrainingStallSuspected`` alert firing (``alert_firing`` in the journal);
* kill: the controller's ``stall_restart`` action, after it confirmed the stall with its
  own evidence (``action_taken``; its ``confirmation`` says how long that took);
* restart: the first ``rank_started`` of the new attempt;
* first step: the first step the new attempt completed (rank 0's metrics log).

Goal: first step <= 30 s on a 2- or 4-rank CPU job. The process tree is stopped after
each repeat (SIGCONT to the frozen rank first, then SIGINT to ``trainwatch run``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainwatch.drill.agent_findings import FindingsWatcher
from trainwatch.process.proctree import stop
from trainwatch.rundir.run_dir import RunDir

PHASES = ("detect", "alert", "kill", "restart", "first_step")


def _wait(what: str, timeout: float, check, every: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def _training(run: RunDir, nproc: int, min_step: int):
    """Status of every rank once all run and rank 0 is past ``min_step``, else None."""
    records = {r["rank"]: r for r in run.statuses().records if isinstance(r.get("rank"), int)}
    if len(records) < nproc or any(r.get("state") != "running" for r in records.values()):
        return None
    step = records.get(0, {}).get("step")
    return records if isinstance(step, int) and step >= min_step else None


def _first_step_after(run: RunDir, after: float) -> float | None:
    """End time of the first step rank 0 completed after ``after`` (the metrics log's tail)."""
    try:
        with open(run.metrics_file(0), "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - (1 << 20)))
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("kind") == "step" and isinstance(record.get("time"), (int, float)) \
                and record["time"] > after:
            return float(record["time"])
    return None


def one(tmp: Path, nproc: int, timeout: float) -> dict:
    run = RunDir(tmp / f"run-{time.time_ns()}")
    log = open(tmp / "run.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "trainwatch", "run", "--nproc-per-node",
                             str(nproc), "--run-dir", str(run.root), "--steps", "1000000",
                             "--no-live"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    frozen = None
    try:
        statuses = _wait("the ranks to train", 300, lambda: _training(run, nproc, 30))
        victim = max(statuses)  # the last rank: rank 0 keeps the metrics log going
        frozen = statuses[victim]["pid"]
        watcher = FindingsWatcher(run)
        t0 = time.time()
        os.kill(frozen, signal.SIGSTOP)
        times: dict[str, float | None] = dict.fromkeys(PHASES)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and times["first_step"] is None:
            watcher.poll()
            stalls = [f for f in watcher.findings() if f.get("kind") == "stall"
                      and f["detected_at"] >= t0]
            if stalls and times["detect"] is None:
                times["detect"] = stalls[0]["detected_at"]
            events = [e for e in run.events() if isinstance(e.get("time"), (int, float))
                      and e["time"] >= t0]
            for key, match in (("alert", lambda e: e["event"] == "alert_firing"
                                and e.get("alert") == "TrainingStallSuspected"),
                               ("kill", lambda e: e["event"] == "action_taken"),
                               ("restart", lambda e: e["event"] == "rank_started")):
                if times[key] is None:
                    hit = next((e["time"] for e in events if match(e)), None)
                    times[key] = hit
            if times["restart"] is not None:
                times["first_step"] = _first_step_after(run, times["restart"])
            time.sleep(0.25)
        return {k: (None if v is None else round(v - t0, 2)) for k, v in times.items()}
    finally:
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGCONT)
            except ProcessLookupError:
                pass
        stop(proc, signal.SIGINT, grace=90)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything of the tree still around
        except ProcessLookupError:
            pass
        log.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=240.0,
                        help="seconds after the SIGSTOP to wait for the first resumed step")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="tw-stall-bench-") as tmp:
        runs = [one(Path(tmp), args.nproc, args.timeout) for _ in range(args.repeats)]
    out = {"nproc": args.nproc, "runs": runs,
           "load_average_1m": [load, os.getloadavg()[0]],
           "median": {k: statistics.median(r[k] for r in runs if r[k] is not None)
                      if any(r[k] is not None for r in runs) else None for k in PHASES}}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"stall -> first resumed step, {args.nproc} ranks, default settings, "
          f"{args.repeats} run(s) (load average {load:.1f} -> {os.getloadavg()[0]:.1f}); "
          "seconds after the SIGSTOP")
    print("  " + " ".join(f"{k:>10}" for k in PHASES))
    for r in runs:
        print("  " + " ".join(f"{'-' if r[k] is None else r[k]:>10}" for k in PHASES))
    first = out["median"]["first_step"]
    print(f"  first resumed step: {first} s (goal <= 30 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
