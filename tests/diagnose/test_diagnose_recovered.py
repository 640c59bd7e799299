"""diagnose on a run that recovered: a rank SIGKILLed in attempt 1, the controller
(`trainwatch run`) restarted the job from the newest state every rank had (a memory
snapshot or a survivor's dying gasp, by default: at most one step before the kill) and it
finished. The earlier death is history, not the current verdict."""

import json
import subprocess
import sys

import pytest

from conftest import torchrun_env
from trainwatch.rundir.run_dir import RunDir

pytestmark = pytest.mark.slow


def test_finished_run_reports_an_earlier_attempts_death_as_history(tmp_path):
    (tmp_path / "train.yaml").write_text(
        "train: {steps: 30, batch_size: 4, eval_interval: 1000}\n"
        "checkpoint: {every_steps: 10, fsync: false}\n"
        "telemetry: {heartbeat_interval: 0.2}\n")
    run_dir = tmp_path / "exp"
    done = subprocess.run(
        [sys.executable, "-m", "trainwatch", "run", "--nproc-per-node", "2", "--run-dir",
         str(run_dir), "--config", str(tmp_path / "train.yaml"), "--max-restarts", "0",
         "--no-live"],
        env=torchrun_env(tmp_path, TRAINWATCH_FAULT="kill:rank=1:step=15:launch=1"),
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "rank 1 killed by SIGKILL" in done.stdout  # the first attempt did die

    diag = subprocess.run([sys.executable, "-m", "trainwatch", "diagnose", str(run_dir),
                           "--json"], capture_output=True, text=True, timeout=300)
    report = json.loads(diag.stdout)
    findings = [(f["category"], f["severity"], f["title"]) for f in report["findings"]]
    assert diag.returncode == 0, findings
    assert not [f for f in findings if f[1] in ("critical", "warning")], findings
    assert findings[0] == ("healthy", "info", "the run finished"), findings
    history = [f for f in report["findings"] if f["category"] == "rank_dead"]
    assert len(history) == 1, findings
    assert history[0]["severity"] == "info" and history[0]["ranks"] == [1]
    # the step the ranks resumed from, as they journaled it (step 15's gasp or snapshot)
    (resumed,) = {e["step"] for e in RunDir(run_dir).events("checkpoint_resumed")}
    assert 14 <= resumed <= 15
    assert history[0]["title"] == ("rank 1 died in attempt 1 (killed by SIGKILL); recovered: "
                                   f"attempt 2 restarted from step {resumed}"), history[0]["title"]

    human = subprocess.run([sys.executable, "-m", "trainwatch", "diagnose", str(run_dir)],
                           capture_output=True, text=True, timeout=300)
    assert human.returncode == 0 and "critical" not in human.stdout, human.stdout
    assert "info · rank_dead" in human.stdout and "recovered: attempt 2" in human.stdout, \
        human.stdout
