"""The 4-rank proof of sharded resume, too slow for CI on 2 cores: run once, by hand.

    python benchmarks/sharded_resume_4ranks.py [--dir DIR] [--json]

Real torchrun gloo jobs on CPU of tests/jobs/fsdp2_train.py (a user's FSDP2 loop with the
documented Checkpoints lines, seeded, its loader positioned by the global sample count;
rank 0 writes the digest of the gathered full model + AdamW state after every step):

1. 4 ranks, a save every 2 steps (async), memory snapshots off; rank 1 is SIGKILLed
   before step 6 (after step 4's save is sealed); torchrun restarts all four, which resume
   from step 4 and train to 6. Exact: the digest resumed at step 4 and those trained at 5
   and 6 equal the first attempt's (an uninterrupted run up to the kill) at those steps.
2. 4 -> 2: the same run directory at 2 ranks resumes step 6 (written by 4 ranks,
   resharded by DCP) and trains to 8. Exact: the digest resumed at 6 equals the 4-rank
   run's at 6; the manifest of step 8 says world size 2 and 64 samples (8 steps x 8).

Prints each check with its digests and the wall time of each job; exit 1 if one fails.
The CI tests run the same at 2 ranks and 2 -> 1 (tests/rank/test_checkpoint_sharded_e2e.py);
the figures are in docs/checkpoints.md, "Sharded models".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = Path(__file__).resolve().parents[1] / "tests" / "jobs" / "fsdp2_train.py"


def _job(out: Path, run: Path, nproc: int, *args: str) -> tuple[list[dict], float]:
    out.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINWATCH_RUN_DIR": str(run),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nproc}", "--max-restarts=1",
                           "--monitor-interval=0.1", str(JOB), "--out", str(out), *args],
                          env=env, capture_output=True, text=True, timeout=600)
    took = time.monotonic() - started
    if proc.returncode != 0:
        sys.exit(f"the {nproc}-rank job failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    lines = [json.loads(x) for x in (out / "digests.jsonl").read_text().splitlines()]
    return lines, took


def _at(lines: list[dict], step: int, what: str, attempt: int | None = None) -> str:
    found = [d for d in lines if d["step"] == step and d["what"] == what
             and (attempt is None or d["attempt"] == attempt)]
    return found[-1]["digest"] if found else "(none)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="sharded-4ranks-", dir=args.dir))
    run = root / "run"
    four, four_s = _job(root / "four", run, 4, "--kill-at", "5", "--memory-snapshots", "off")
    two, two_s = _job(root / "two", run, 2, "--steps", "8", "--memory-snapshots", "off")
    manifest = json.loads((run / "checkpoints" / "step-00000008" / "manifest.json").read_text())
    checks = {
        "4 ranks, rank 1 SIGKILLed: resumed at 4 == uninterrupted at 4":
            (_at(four, 4, "resumed"), _at(four, 4, "trained", 0)),
        "4 ranks: trained again at 5 == uninterrupted at 5":
            (_at(four, 5, "trained", 1), _at(four, 5, "trained", 0)),
        "4 -> 2: resumed at 6 (2 ranks) == 4 ranks at 6":
            (_at(two, 6, "resumed"), _at(four, 6, "trained", 1)),
        "4 -> 2: step 8's manifest: world size 2, 64 samples":
            (json.dumps([manifest["world_size"], manifest["data_position"]]),
             json.dumps([2, [{"samples": 64}, {"samples": 64}]])),
    }
    ok = all(a == b for a, b in checks.values())
    result = {"ok": ok, "four_ranks_seconds": round(four_s, 1),
              "two_ranks_seconds": round(two_s, 1),
              "checks": {k: {"equal": a == b, "got": a, "want": b} for k, (a, b) in checks.items()}}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for name, (a, b) in checks.items():
            print(f"{'OK ' if a == b else 'BAD'} {name}: {a[:16]} / {b[:16]}")
        print(f"4-rank job (kill + restart): {four_s:.1f} s; 2-rank resume: {two_s:.1f} s; "
              f"{root}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
