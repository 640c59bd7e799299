"""Synthetic run directories for the report's tests: written with the run-directory writers
(RunDir, append_jsonl) at chosen times, so every category has an exact expected value."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainwatch.report.goodput import CATEGORIES
from trainwatch.rundir.atomic import append_jsonl
from trainwatch.rundir.run_dir import RunDir

T0 = 1_800_000_000.0


class Run:
    """Writes a run directory the way the trainer, launcher and controller do, at given times."""

    def __init__(self, root: Path, *, world_size: int = 2, steps: int = 30, every: int = 10):
        self.run = RunDir(root).create()
        self.run.write_run_info({"job": "synth", "world_size": world_size, "nproc_per_node":
                                 world_size, "config": {"train": {"steps": steps},
                                                        "checkpoint": {"every_steps": every}}})
        self.world_size = world_size
        self.clock = 0.0
        self.pid = 100

    def event(self, name: str, source: str, at: float | None = None, **fields) -> None:
        append_jsonl(self.run.journal_file, {"v": 1, "time": T0 + (self.clock if at is None
                                                                    else at),
                                             "event": name, "source": source, "host": "h",
                                             **fields})

    def rank_event(self, name: str, rank: int = 0, **fields) -> None:
        self.event(name, f"rank{rank}", rank=rank, **fields)

    def attempt(self, restart_count: int = 0) -> list[int]:
        pids = []
        for rank in range(self.world_size):
            self.pid += 1
            pids.append(self.pid)
            self.rank_event("rank_started", rank, pid=self.pid, restart_count=restart_count)
        return pids

    def steps(self, first: int, last: int, *, seconds: float = 1.0, gap: float = 0.0,
              data_wait: float = 0.1, tokens: int = 512, slow: dict | None = None) -> None:
        """Steps first..last on rank 0 (and rank 1's log, for the world-size check)."""
        for step in range(first, last + 1):
            length = (slow or {}).get(step, seconds)
            self.clock += length
            for rank in range(self.world_size):
                append_jsonl(self.run.metrics_file(rank), {
                    "v": 1, "kind": "step", "step": step, "time": T0 + self.clock, "rank": rank,
                    "step_time_seconds": length, "data_wait_seconds": data_wait,
                    "phase_seconds": {"data": data_wait}, "tokens": tokens, "loss": 1.0})
            self.clock += gap

    def evaluation(self, step: int, seconds: float) -> None:
        self.clock += seconds
        append_jsonl(self.run.metrics_file(0), {"v": 1, "kind": "eval", "step": step,
                                                "time": T0 + self.clock, "rank": 0,
                                                "val_loss": 2.0})

    def save(self, step: int, blocking: float, *, reason: str = "interval") -> None:
        """A checkpoint save that blocks the loop ``blocking`` s (async: journaled later)."""
        self.clock += blocking
        self.rank_event("checkpoint_saved", step=step, blocking_seconds=blocking,
                        write_seconds=0.05, waited_seconds=0.0, mode="async", reason=reason,
                        at=self.clock + 0.05)

    def wait(self, seconds: float) -> None:
        self.clock += seconds

    def torchrun_failed(self, pid: int, local_rank: int, code: int) -> None:
        with open(self.run.logs_dir / "torchrun.log", "a") as fh:
            fh.write(f"E1202 14:28:10.981000 5188 site-packages/torch/distributed/elastic/"
                     f"multiprocessing/api.py:1002] failed (exitcode: {code}) local_rank: "
                     f"{local_rank} (pid: {pid}) of binary: /usr/bin/python\n")


def near(value):
    """Times are Unix seconds near 1.8e9: doubles resolve them to about 2.4e-7 s."""
    return pytest.approx(value, abs=1e-5)


def report(run_dir, *args, expect=0):
    done = subprocess.run([sys.executable, "-m", "trainwatch", "report", str(run_dir), *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == expect, done.stdout + done.stderr
    return done


def report_json(run_dir, *args):
    return json.loads(report(run_dir, "--json", *args).stdout)


def assert_sums_to_wall(data):
    t = data["time"]
    assert sum(data["categories"][c] for c in CATEGORIES) == pytest.approx(
        t["wall_seconds"], abs=1e-6)
    assert t["wall_seconds"] + t["not_running_seconds"] == pytest.approx(t["span_seconds"],
                                                                         abs=1e-6)
    assert t["span_seconds"] == pytest.approx(t["end"] - t["start"], abs=1e-6)
