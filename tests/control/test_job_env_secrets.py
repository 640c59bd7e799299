"""Secrets of the controller's environment never reach the job or anything trainwatch shows.

A real `trainwatch alerts receive` supervises a real job process; its environment holds
the receiver's token and other *_TOKEN / *_KEY / *_SECRET / *_PASSWORD values. The job
records what it got; an agent watches the run (reading the job's environment, as it does
for the NCCL checks) and `trainwatch diagnose --bundle` packs the evidence. None of the
secret values may appear in the job's environment, the agent's /status or /metrics, any
log, or the bundle. A key named in TRAINWATCH_PASS_ENV reaches the job (and nothing else);
the receiver's own token never does, named or not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

from agent_helpers import free_port, get_json, http_get, start_agent, stop_process, wait_for
from trainwatch.control.jobenv import job_environment

SECRETS = {"TRAINWATCH_RECEIVER_TOKEN": "tw-receiver-s3cret-7f1c",
           "HF_TOKEN": "hf-s3cret-2b9d", "CLOUD_API_KEY": "cloud-s3cret-8e4a",
           "S3_SECRET": "s3-s3cret-c0d7", "db_password": "db-s3cret-5a1e",
           "AWS_SHARED_CREDENTIALS": "aws-s3cret-9f3b"}
PASSED = {"TRACKER_API_KEY": "tracker-key-passed-6d2c"}

JOB = """
import json, os, sys, time
from trainwatch.rundir.run_dir import RunDir
run = RunDir(sys.argv[1]).create()
with open(sys.argv[2], "w") as fh:
    json.dump(dict(os.environ), fh)
print("job environment names:", sorted(os.environ), flush=True)
step = 0
while True:
    step += 1
    run.write_status(0, {"job": run.root.name, "rank": 0, "pid": os.getpid(),
                         "state": "running", "step": step, "heartbeat_at": time.time()})
    time.sleep(0.2)
"""


def test_job_environment_drops_secret_names_and_keeps_the_rest():
    env = {"PATH": "/bin", "NCCL_DEBUG": "WARN", "MASTER_ADDR": "n1", "KEYBOARD": "us",
           "TOKENIZERS_PARALLELISM": "false", **SECRETS, **PASSED,
           "TRAINWATCH_PASS_ENV": "TRACKER_API_KEY, TRAINWATCH_RECEIVER_TOKEN"}
    got = job_environment(env)
    assert not set(SECRETS) & set(got)
    assert got["TRACKER_API_KEY"] == PASSED["TRACKER_API_KEY"]
    assert {"PATH", "NCCL_DEBUG", "MASTER_ADDR", "KEYBOARD", "TOKENIZERS_PARALLELISM"} <= set(got)


def test_secrets_never_reach_the_job_status_metrics_logs_or_bundle(tmp_path):
    script, seen = tmp_path / "job.py", tmp_path / "job-env.json"
    script.write_text(JOB)
    run_dir = tmp_path / "exp1"
    env = {**os.environ, **SECRETS, **PASSED, "TRAINWATCH_PASS_ENV": "TRACKER_API_KEY"}
    port = free_port()
    receiver_log = tmp_path / "receiver.log"
    receiver = subprocess.Popen(
        [sys.executable, "-m", "trainwatch", "-v", "alerts", "receive", "--run-dir",
         str(run_dir), "--listen", f"127.0.0.1:{port}",
         "--job-command", f"{sys.executable} {script} {run_dir} {seen}"],
        env=env, stdout=open(receiver_log, "wb"), stderr=subprocess.STDOUT)
    agent = url = None
    try:
        wait_for(lambda: seen.exists() and seen.read_text().endswith("}"), 60,
                 what=f"the job started: {receiver_log.read_text()[-2000:]}")
        got = json.loads(seen.read_text())
        assert not set(SECRETS) & set(got), "a secret reached the job"
        assert got["TRACKER_API_KEY"] == PASSED["TRACKER_API_KEY"]  # named, so passed on

        agent, url = start_agent(tmp_path, "--run-dir", str(run_dir))
        wait_for(lambda: get_json(url + "/status")["jobs"][0]["ranks"], 30,
                 what="the agent sees the job")
        shown = [http_get(url + "/status"), http_get(url + "/metrics")]
        bundle = tmp_path / "evidence.tar.gz"
        out = subprocess.run([sys.executable, "-m", "trainwatch", "diagnose", "--run-dir",
                              str(run_dir), "--agent", url, "--bundle", str(bundle)],
                             env=env, capture_output=True, timeout=120)
        assert bundle.exists(), out.stdout + out.stderr
        shown += [out.stdout, out.stderr]
        with tarfile.open(bundle) as tar:
            shown += [tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()]
    finally:
        if agent is not None:
            stop_process(agent)
        stop_process(receiver)
    shown += [receiver_log.read_bytes(), *(p.read_bytes() for p in tmp_path.glob("agent-*.log"))]
    shown += [p.read_bytes() for p in run_dir.rglob("*") if p.is_file()]
    for value in [*SECRETS.values(), PASSED["TRACKER_API_KEY"]]:
        leaks = [i for i, blob in enumerate(shown) if value.encode() in blob]
        assert not leaks, f"{value} leaked into {len(leaks)} of {len(shown)} outputs"
