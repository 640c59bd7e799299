"""False alarms of the replica check: a long clean DDP run, its agent watching.

    python benchmarks/replica_false_alarms.py --steps 10000 --every 5

Runs the reference trainer (``trainwatch train``, 3 gloo ranks, no fault, digests every
``--every`` steps) with an agent on its run directory, scraping the agent's /metrics every
second: any ``trainwatch_replica_divergence_digests`` series or a non-zero
``trainwatch_replica_digest_mismatch`` is a false alarm. At the end the ranks' logged
digests are compared step by step as the rollback reads them (control/replica_rollback.py).
Prints the steps, the digests compared by the agent and in the logs, and the alarms.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from trainwatch.agent.replicas import digest, vote
from trainwatch.rundir.run_dir import RunDir


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10000)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=3)
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="trainwatch-sdc-"))
    run_dir = scratch / "clean"
    RunDir(run_dir).create()
    port = _port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch)}
    env.pop("TRAINWATCH_FAULT", None)
    agent = subprocess.Popen([sys.executable, "-m", "trainwatch", "agent", "--listen",
                              f"127.0.0.1:{port}", "--run-dir", str(run_dir)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    train = subprocess.Popen(
        [sys.executable, "-m", "trainwatch", "train", "--nproc-per-node", str(args.nproc),
         "--run-dir", str(run_dir), "--steps", str(args.steps),
         "--set", f"telemetry.replica_every={args.every}", "--set", "train.eval_interval=0",
         "--set", "train.milestone_interval=0", "--set", "checkpoint.every_steps=0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
    alarms, compared_steps, scrapes = [], set(), 0
    started = time.time()
    try:
        while True:
            done = train.poll() is not None
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    text = r.read().decode()
                scrapes += 1
            except OSError:
                text = ""
            for line in text.splitlines():
                if line.startswith("trainwatch_replica_divergence_digests{"):
                    alarms.append(line)
                m = re.match(r"trainwatch_replica_digest_mismatch\{.*\} (\S+)$", line)
                if m and float(m.group(1)) != 0:
                    alarms.append(line)
                m = re.match(r"trainwatch_replica_digest_step\{.*\} (\S+)$", line)
                if m:
                    compared_steps.add(int(float(m.group(1))))
            if done:
                break
            time.sleep(1.0)
    finally:
        for proc in (train, agent):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
    run = RunDir(run_dir)
    steps: dict[int, dict[int, dict]] = {}
    for rank in run.ranks_with_metrics():
        for record in run.metrics(rank).records:
            if record.get("kind") == "replicas" and (d := digest(record)) is not None:
                steps.setdefault(d["step"], {})[rank] = d
    disagreeing = [s for s, by_rank in steps.items() if vote(by_rank)[0]]
    print(f"trainer exit {train.returncode} after {time.time() - started:.0f} s; "
          f"{args.nproc} ranks, {args.steps} steps, a digest every {args.every}")
    print(f"logged digests compared: {len(steps)} steps, "
          f"{sum(len(v) == args.nproc for v in steps.values())} with every rank; "
          f"disagreeing: {len(disagreeing)} {disagreeing[:5]}")
    print(f"agent: {scrapes} scrapes, newest compared step seen at {len(compared_steps)} "
          f"distinct values (last {max(compared_steps, default=None)}); "
          f"alarm samples: {len(alarms)} {alarms[:3]}")
    return 0 if train.returncode == 0 and not alarms and not disagreeing else 1


if __name__ == "__main__":
    sys.exit(main())
