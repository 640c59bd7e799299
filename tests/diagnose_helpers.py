"""A real torchrun job for diagnose to look at, and reading diagnose's answer."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from agent_helpers import wait_for
from conftest import REPO, kill_tree, torchrun_env
from trainwatch.rundir.run_dir import RunDir

JOB = str(REPO / "tests" / "jobs" / "diagnose_job.py")


class Job:
    """A torchrun job, killed with all its ranks by the finalizer."""

    def __init__(self, tmp_path: Path, nproc: int = 2, steps: int = 100000,
                 trainer: bool = False, launcher_args: tuple[str, ...] = (),
                 prefix: tuple[str, ...] = (), **env: str):
        self.run = RunDir(tmp_path / "run").create()
        self.nproc = nproc
        if trainer:  # the reference trainer; its launcher writes logs/torchrun.log itself
            self.log = open(tmp_path / "launcher.out", "wb")
            cmd = [sys.executable, "-m", "trainwatch", "train", f"--nproc-per-node={nproc}",
                   "--max-restarts=0", "--run-dir", str(self.run.root), "--steps", str(steps),
                   "--set", "telemetry.heartbeat_interval=0.2"]
        else:
            self.log = open(self.run.logs_dir / "torchrun.log", "wb")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={nproc}", "--max-restarts=0", *launcher_args, JOB,
                   str(self.run.root), str(steps)]
        self.proc = subprocess.Popen(
            [*prefix, *cmd], env=torchrun_env(tmp_path, **{"TORCH_FR_BUFFER_SIZE": "2000", **env}), cwd=REPO,
            stdout=self.log, stderr=subprocess.STDOUT)

    def statuses(self) -> dict[int, dict]:
        return {s["rank"]: s for s in self.run.statuses().records}

    def wait(self, predicate, what: str, timeout: float = 120) -> dict[int, dict]:
        deadline = time.time() + timeout
        while time.time() < deadline:
            statuses = self.statuses()
            if len(statuses) == self.nproc and predicate(statuses):
                return statuses
            if self.proc.poll() is not None and not predicate(statuses):
                break
            time.sleep(0.2)
        raise AssertionError(f"job never reached: {what}\n{self.tail()}")

    def wait_step(self, step: int) -> dict[int, dict]:
        return self.wait(lambda s: all((r.get("step") or 0) >= step for r in s.values()),
                         f"step {step}")

    def pid(self, rank: int) -> int:
        return self.statuses()[rank]["pid"]

    def tail(self) -> str:
        with open(self.log.name, errors="replace") as fh:
            return fh.read()[-3000:]

    def stop(self) -> None:
        """Kill torchrun and every rank it started (ranks run in sessions of their own)."""
        pids = {s["pid"] for s in self.statuses().values()}
        try:
            pids |= {c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
        for pid in pids:
            try:
                rank = psutil.Process(pid)
                if not any(str(self.run.root) in arg for arg in rank.cmdline()):
                    continue  # a reused pid is not ours
                rank.send_signal(signal.SIGCONT)
                rank.kill()
            except psutil.Error:
                pass
        self.proc.wait(timeout=30)
        self.log.close()


@contextlib.contextmanager
def jobs_in(tmp_path: Path):
    """Start ``Job``s in ``tmp_path`` (``start(**kwargs)``); each is stopped, with its ranks,
    at the end."""
    started: list[Job] = []

    def start(**kwargs) -> Job:
        started.append(Job(tmp_path, **kwargs))
        return started[-1]
    try:
        yield start
    finally:
        for job in started:
            job.stop()


def stopped_with_ctrl_c(tmp_path: Path) -> tuple[RunDir, str]:
    """A run its user stopped with Ctrl-C on `trainwatch run` once both ranks are past step
    10; its job does not save on SIGTERM, so its ranks die by the signal with statuses still
    saying "running". The run and what `trainwatch run` printed."""
    run = RunDir(tmp_path / "run")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainwatch", "run", str(run.root), "--no-live", "--",
         sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", JOB, str(run.root), "100000"],
        env=torchrun_env(tmp_path, STEP_SLEEP="0.05"), cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: len(run.statuses().records) == 2 and all(
            (s.get("steps_completed") or 0) >= 10 for s in run.statuses().records), 180,
            what="both ranks past step 10")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 130, out[-3000:]
    finally:
        kill_tree(proc)
    return run, out


def diagnose(run: RunDir, *args: str, timeout: float = 60) -> tuple[int, dict, str]:
    proc = subprocess.run([sys.executable, "-m", "trainwatch", "diagnose", "--run-dir",
                           str(run.root), "--json", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout), proc.stdout + proc.stderr


def top(report: dict, category: str | None = None) -> dict:
    findings = report["findings"]
    if category:
        matching = [f for f in findings if f["category"] == category]
        assert matching, f"no {category} finding in {[f['title'] for f in findings]}"
        return matching[0]
    return findings[0]


LIMIT_S = 20  # diagnose answers within this on every hard case


def timed_diagnose(run: RunDir, *args: str) -> tuple[int, dict, str]:
    """diagnose, printing how long it took and failing past ``LIMIT_S``."""
    started = time.monotonic()
    code, report, output = diagnose(run, *args)
    elapsed = time.monotonic() - started
    print(f"diagnose: {elapsed:.1f} s")
    assert elapsed < LIMIT_S, f"diagnose took {elapsed:.1f} s"
    return code, report, output


def no_confident_wrong(report: dict, culprit: int) -> None:
    """No critical high-confidence finding blames a rank other than the culprit."""
    wrong = [f["title"] for f in report["findings"] if f["confidence"] == "high"
             and f["severity"] == "critical" and f["ranks"] and culprit not in f["ranks"]]
    assert not wrong, wrong


def stalled_for(seconds: float):
    return lambda s: all(time.time() - r["last_progress_at"] > seconds for r in s.values())


def blocked_python(source: str, kind: str, tmp_path: Path,
                   *args: str) -> tuple[subprocess.Popen, dict]:
    """A Python child running ``source`` (a real file, so diagnose can read its lines) until
    its main thread's kernel wait is of ``kind``; returns it and its real py-spy stack."""
    from trainwatch.diagnose import stacks
    from trainwatch.host.procinfo import thread_waits
    script = tmp_path / "job.py"
    script.write_text(source)
    child = subprocess.Popen([sys.executable, str(script), *args])

    pyspy = stacks.find_py_spy()
    assert pyspy, "py-spy is installed with trainwatch"

    def waiting() -> bool:
        main = next((t for t in thread_waits(child.pid) if t["tid"] == child.pid), None)
        return bool(main and (main["wait"] or {}).get("kind") == kind)

    def where(dump: dict | None) -> list[tuple]:
        return [(f.get("file"), f.get("line")) for f in stacks.main_stack(dump)]

    def blocked() -> dict | None:
        """Blocked for good, not in a passing wait of start-up: in a ``kind`` wait before and
        after two py-spy stacks that agree and reach job.py (a child still running its
        module code can be caught in a brief futex wait between two of its lines)."""
        if not waiting():
            return None
        dump = stacks.py_spy_dump(pyspy, child.pid, 30, False, False)
        frames = where(dump)
        if not any(file == str(script) for file, _ in frames) or not waiting():
            return None
        return dump if where(stacks.py_spy_dump(pyspy, child.pid, 30, False, False)) == frames \
            else None
    try:
        dump = wait_for(blocked, timeout=30, what=f"the child blocked in a {kind} wait")
        # py-spy stops the process to read it; its thread re-enters the wait just after, and
        # a caller reading /proc in between would see it running.
        wait_for(waiting, timeout=30, what=f"the child back in its {kind} wait")
    except BaseException:
        child.kill()
        child.wait()
        raise
    return child, dump
