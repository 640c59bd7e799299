"""Helpers for the control tests: a fake job the controller supervises, and webhook calls."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import json
import urllib.error
import urllib.request

from conftest import fill_to_the_brim
from trainwatch.rundir.run_dir import RunDir


TOKEN = "s3cret-token-for-tests"


JOB_SCRIPT = """
import os, sys, time

from trainwatch.rundir.run_dir import RunDir
run = RunDir(sys.argv[1]).create()
# resume from the newest "checkpoint", like the trainer
step = max([int(p.name.split("-")[1]) for p in run.checkpoint_dir.glob("step-*")], default=0)
with open(run.root / "starts.txt", "a") as fh:
    fh.write(f"{os.getpid()} {step}\\n")
if os.environ.get("LAUNCH_FAIL"):  # before any rank published anything
    sys.exit(1)
if os.environ.get("CRASH"):  # a rank that started, then crashed
    run.write_status(0, {"job": run.root.name, "rank": 0, "pid": os.getpid(), "node": "n1",
                         "state": "running", "step": step, "heartbeat_at": time.time()})
    sys.exit(1)
while True:
    step += 1
    if step % 5 == 0:  # a "checkpoint" every 5 steps, journaled like the trainer does
        (run.checkpoint_dir / f"step-{step:08d}").mkdir(exist_ok=True)
        run.append_event("checkpoint_saved", "rank0", step=step,
                         path=str(run.checkpoint_dir / f"step-{step:08d}"))
    run.write_status(0, {"job": run.root.name, "rank": 0, "pid": os.getpid(), "node": "n1",
                         "state": "running", "step": step, "metrics": {"step": step},
                         "heartbeat_at": time.time()})
    time.sleep(0.1)
"""


def _post(url, body, token=TOKEN, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url + "/webhook", data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _payload(alertname="TrainingStallSuspected", status="firing", starts="2026-12-02T10:00:00Z",
             fingerprint="a1b2c3d4e5f60718", job="exp1"):
    alert = {"status": status, "labels": {"alertname": alertname, "run": job, "rank": "0",
                                          "severity": "critical"},
             "annotations": {"summary": "x"}, "startsAt": starts,
             "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "", "fingerprint": fingerprint}
    return {"version": "4", "groupKey": "{}:{}", "truncatedAlerts": 0, "status": status,
            "receiver": "trainwatch", "groupLabels": {}, "commonLabels": alert["labels"],
            "commonAnnotations": {}, "externalURL": "", "alerts": [alert]}


def _starts(run: RunDir, field: int = 0) -> list[int]:
    """The job's starts: pids (field 0) or the step each start resumed from (field 1)."""
    path = run.root / "starts.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    return [int(line.split()[field]) for line in lines if line.strip()]


def start_run(tmp_path, run_dir, *args, nproc=2, env=None):
    """`trainwatch run` of the reference trainer on tmp_path/train.yaml, in the background:
    its output in tmp_path/run.log, its TMPDIR tmp_path/scratch, one thread per rank."""
    cmd = [sys.executable, "-m", "trainwatch", "run", "--nproc-per-node", str(nproc),
           "--run-dir", str(run_dir), "--config", str(tmp_path / "train.yaml"), "--no-live",
           *args]
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    return subprocess.Popen(cmd, stdout=open(tmp_path / "run.log", "wb"),
                            stderr=subprocess.STDOUT,
                            env={**os.environ, "TMPDIR": str(scratch), "OMP_NUM_THREADS": "1",
                                 **(env or {})})


def _run(tmp_path, run_dir, *extra, env=None):
    return start_run(tmp_path, run_dir, "--thresholds", str(tmp_path / "thresholds.yaml"),
                     "--agent-config", str(tmp_path / "agent.yaml"), *extra, env=env)


def _finish(proc, timeout=420):
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # trainwatch run stops everything it started
        proc.wait(timeout=60)
        raise


def fill_run_dir_and_logs(run: RunDir) -> None:
    """The run directory full, every log's last page too, as a long run's would be: a log
    appended to takes lines in the free end of its last page even on a full disk. A rank's
    own files (torchrun writes them at its own offset, without appending) give their pages
    back first, so its next line needs a new page, as at a page boundary."""
    for path in run.logs_dir.glob("torchrun/*/attempt_*/*/std*.log"):
        os.truncate(path, 0)
    fill_to_the_brim(run.root)
    for path in run.logs_dir.glob("*.log"):
        with open(path, "ab", buffering=0) as fh:
            size = 4096
            while size:
                try:
                    fh.write(b"." * (size - 1) + b"\n")
                except OSError:
                    size //= 2
