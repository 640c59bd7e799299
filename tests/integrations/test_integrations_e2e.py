"""The Lightning and Hugging Face Trainer callbacks under `trainwatch run -- torchrun ...`:
real packages, tiny models, 2 CPU ranks, the two runs side by side.

The agent shows both ranks' step and loss; a checkpoint-now request (control/checkpoint,
CheckpointTooOld's action) is saved through the framework's own checkpointing and sealed;
a SIGKILLed rank is restarted and the job resumes from that checkpoint and finishes
from the newer memory snapshot every rank has, at most a step back, with the weights the
first run had at that step.
"""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import kill_tree
from trainwatch.rundir.run_dir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("trainwatch.agent.daemon") is None, reason="needs the agent")]
HERE = Path(__file__).resolve().parent
JOBS = {"lightning": ("lightning", HERE.parent / "jobs" / "lightning_job.py"),
        "transformers": ("transformers", HERE.parent / "jobs" / "hf_job.py")}
STEPS = 60


def _metric(text, name, rank):
    match = re.search(rf'^{name}{{[^}}]*rank="{rank}"[^}}]*}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else None


class Job:
    def __init__(self, root, configs, kind):
        self.kind = kind
        self.run = RunDir(root / kind)
        self.log = root / f"{kind}.log"
        cmd = [sys.executable, "-m", "trainwatch", "run", "--run-dir", str(self.run.root),
               "--no-live", "--thresholds", str(configs / "thresholds.yaml"),
               "--agent-config", str(configs / "agent.yaml"), "--",
               "torchrun", "--standalone", "--nproc-per-node", "2", str(JOBS[kind][1]),
               str(STEPS), "0.15"]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "OMP_NUM_THREADS": "1",
                                          "WEIGHTS_LOG": str(root / f"{kind}.weights")})
        self.stage = "wait for steps"
        self.seen = {}
        self.saved_step = None
        self.code = None

    def agent(self):
        match = re.search(r"agent (http://127\.0\.0\.1:\d+)", self.log.read_text())
        return match.group(1) if match else None

    def poke(self):
        """Watch both ranks in the agent, ask for a checkpoint, then kill rank 1."""
        if self.proc.poll() is not None:
            return
        status = {s["rank"]: s for s in self.run.statuses().records}
        if self.stage == "wait for steps":
            url = self.agent()
            if url and all((status.get(r, {}).get("step") or 0) >= 3 for r in (0, 1)):
                try:
                    text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
                except OSError:
                    return
                self.seen = {r: (_metric(text, "trainwatch_rank_step", r),
                                 _metric(text, "trainwatch_train_loss", r)) for r in (0, 1)}
                if all(step is not None and loss is not None
                       for step, loss in self.seen.values()):
                    (self.run.control_dir / "checkpoint").touch()
                    self.stage = "wait for the checkpoint"
        elif self.stage == "wait for the checkpoint":
            saved = [e for e in self.run.events("checkpoint_saved")
                     if e.get("framework") == self.kind]
            # a few steps on, so the newest state is in memory only (Lightning's snapshots)
            if saved and status.get(1, {}).get("state") == "running" and (
                    status[1].get("step") or 0) >= saved[-1]["step"] + 3:
                self.saved_step = saved[-1]["step"]
                os.kill(status[1]["pid"], signal.SIGKILL)
                self.stage = "killed"


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    missing = [kind for kind, (module, _) in JOBS.items()
               if importlib.util.find_spec(module) is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (pip install -e '.[test]')")
    root = tmp_path_factory.mktemp("frameworks")
    (root / "thresholds.yaml").write_text(
        "evaluation_interval: 1s\nstall_for: 2s\naction_min_interval_seconds: 30\n"
        # MSE of a batch of 4 random targets: 3x its mean is noise here, not a spike to roll back
        "loss_spike_factor: 100\n")
    (root / "agent.yaml").write_text(
        "stall: {floor_seconds: 5, k: 10, first_step_seconds: 300}\n"
        "collectors:\n  ranks: {interval: 0.5}\n")
    running = [Job(root, root, kind) for kind in JOBS]
    try:
        deadline = time.time() + 480
        while time.time() < deadline and any(j.proc.poll() is None for j in running):
            for j in running:
                j.poke()
            time.sleep(0.2)
        for j in running:
            j.code = j.proc.wait(timeout=max(1, deadline - time.time()))
        return {j.kind: j for j in running}
    finally:
        for j in running:
            kill_tree(j.proc)


@pytest.mark.parametrize("kind", list(JOBS))
def test_framework_job_is_watched_checkpointed_on_request_and_resumed(jobs, kind):
    job = jobs[kind]
    log = job.log.read_text()[-3000:]
    assert job.code == 0, log
    assert job.stage == "killed", (job.stage, log)
    for rank, (step, loss) in job.seen.items():
        assert step >= 0 and loss > 0, (rank, step, loss)  # the agent showed both ranks
    restarts = [e for e in job.run.events("action_taken")
                if e.get("action") in ("restart", "stall_restart")]
    assert len(restarts) == 1, job.run.events("action_taken", "action_skipped")
    resumed = [e for e in job.run.events("checkpoint_resumed") if e.get("framework") == kind]
    assert resumed and resumed[-1]["step"] >= job.saved_step
    _resumed_from_memory(job, resumed[-1])
    assert job.run.events("finished")
    sealed = [e for e in job.run.events("checkpoint_saved") if e.get("framework") == kind]
    from trainwatch.checkpoint_format.manifest import verify
    assert verify(sealed[0]["path"]).ok or not Path(sealed[0]["path"]).exists()
    # replica_every=5: both DDP ranks digested their parameters, and the digests agree
    digests = {s["rank"]: {d["step"]: d["bits"] for d in s["replicas"]}
               for s in job.run.statuses().records}
    common = set(digests[0]) & set(digests[1])
    assert common and all(digests[0][s] == digests[1][s] for s in common), digests


def _resumed_from_memory(job, resumed):
    """The restart resumed from a memory snapshot newer than the durable checkpoint, at most
    one step before the newest step the killed run reached, with its weights at that step."""
    assert resumed["state_from"] == "memory snapshot", resumed
    assert resumed["step"] > resumed["durable_step"] and resumed["steps_lost"] <= 1, resumed
    log = [json.loads(line) for line in
           (job.log.parent / f"{job.kind}.weights").read_text().splitlines()]
    first, again = log[0]["pid"], [e for e in log if "start" in e][-1]
    weights = {e["step"]: e["digest"] for e in log if e["pid"] == first and "step" in e}
    assert again["start"] == resumed["step"] and max(weights) - again["start"] <= 1, log[-5:]
    assert again["digest"] == weights[again["start"]], "resumed weights differ from the run's"


@pytest.mark.parametrize("kind", list(JOBS))
def test_framework_checkpoints_are_first_class(jobs, kind):
    """The framework's sealed checkpoints are the run's: the controller resumes from one
    (not "no checkpoint found"), `checkpoint verify RUN_DIR` checks them, the summary
    counts them."""
    job = jobs[kind]
    restart = [e for e in job.run.events("action_taken")
               if e.get("action") in ("restart", "stall_restart")][-1]
    assert restart["resume_from"]["kind"] == "checkpoint", restart
    assert "no checkpoint found" not in restart["reason"]
    verify = subprocess.run([sys.executable, "-m", "trainwatch", "checkpoint", "verify",
                             str(job.run.root)], capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "OK " in verify.stdout
    summary = job.log.read_text()
    assert re.search(r"checkpoints │ \d+, newest at step \d+", summary), summary[-2000:]
