"""How long `trainwatch diagnose` takes on a stalled 4-rank gloo run (goal: <= 20 s).

    python benchmarks/diagnose_latency.py [--ranks 4] [--repeat 5]

Starts tests/jobs/diagnose_job.py under torchrun with the flight recorder on, SIGSTOPs one
rank, and times the whole `python -m trainwatch diagnose --json` command (interpreter
start, rank dumps, py-spy on every rank, analysis) several times, side by side with a
plain `python -m trainwatch --version` start-up so the tool's own share is visible.
Every process it starts is stopped by PID at the end.
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

import psutil

REPO = Path(__file__).resolve().parent.parent


def timed(cmd: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    return time.perf_counter() - started, proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tw-diag-bench-") as tmp:
        run_dir = Path(tmp) / "run"
        (run_dir / "logs").mkdir(parents=True)
        (Path(tmp) / "scratch").mkdir()
        env = {**os.environ, "TMPDIR": str(Path(tmp) / "scratch"), "OMP_NUM_THREADS": "1",
               "TORCH_FR_BUFFER_SIZE": "2000"}
        with open(run_dir / "logs" / "torchrun.log", "wb") as log:
            job = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={args.ranks}", "--max-restarts=0",
                 str(REPO / "tests" / "diagnose_job.py"), str(run_dir), "1000000"],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        ranks: list[psutil.Process] = []
        try:
            deadline = time.time() + 180
            while time.time() < deadline:
                statuses = [json.loads(p.read_text()) for p in (run_dir / "status").glob("*.json")]
                if len(statuses) == args.ranks and all((s.get("step") or 0) >= 10
                                                       for s in statuses):
                    break
                time.sleep(0.5)
            else:
                sys.exit("the job never reached step 10")
            ranks = [psutil.Process(s["pid"]) for s in statuses]
            stopped = next(p for p, s in zip(ranks, statuses) if s["rank"] == args.ranks - 1)
            stopped.send_signal(signal.SIGSTOP)
            time.sleep(3)
            base = [timed([sys.executable, "-m", "trainwatch", "--version"])[0]
                    for _ in range(args.repeat)]
            runs = []
            for _ in range(args.repeat):
                seconds, proc = timed([sys.executable, "-m", "trainwatch", "diagnose",
                                       "--run-dir", str(run_dir), "--json",
                                       "--stall-after", "2"])
                top = json.loads(proc.stdout)["findings"][0]
                runs.append(seconds)
            print(f"diagnose on {args.ranks} ranks (one SIGSTOPped), {args.repeat} runs: "
                  f"median {statistics.median(runs):.2f} s, max {max(runs):.2f} s "
                  f"(goal <= 20 s: {'met' if max(runs) <= 20 else 'NOT met'}); "
                  f"CLI start-up alone median {statistics.median(base):.2f} s; "
                  f"top finding: {top['title']}")
        finally:
            for rank in ranks:
                try:
                    rank.send_signal(signal.SIGCONT)
                    rank.kill()
                except psutil.Error:
                    pass
            job.kill()
            job.wait()


if __name__ == "__main__":
    main()
