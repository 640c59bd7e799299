"""Silent data corruption, for real: a 3-rank torchrun gloo job of the reference trainer
flips one bit of one weight on rank 1 mid-run (TRAINWATCH_FAULT=sdc:...); its agent names
rank 1 within two digests, and the ranks' digests before the fault agree."""

import json
import re

import pytest

from agent_helpers import http_get, start_agent, stop_process, wait_for
from conftest import finish
from diagnose_helpers import diagnose, top
from trainwatch.rundir.run_dir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EVERY, FAULT_STEP, STEPS = 5, 22, 45


def _series(text: str, name: str) -> dict[str, float]:
    return {labels: float(value) for labels, value in
            re.findall(rf"^{name}{{([^}}]*)}} (\S+)$", text, re.M)}


def test_agent_names_the_corrupted_rank_within_two_digests(tmp_path, launch_train):
    run_dir = tmp_path / "exp"
    RunDir(run_dir).create()
    agent, url = start_agent(tmp_path, "--run-dir", str(run_dir))
    try:
        proc = launch_train(
            "--nproc-per-node", "3", "--run-dir", str(run_dir), "--steps", str(STEPS),
            "--set", f"telemetry.replica_every={EVERY}", "--set", "train.eval_interval=1000",
            "--set", "telemetry.heartbeat_interval=0.2",
            env={"TRAINWATCH_FAULT": f"sdc:rank=1:step={FAULT_STEP},slow:delay=0.15"})

        def named():
            text = http_get(url + "/metrics").decode()
            verdict = _series(text, "trainwatch_replica_divergence_digests")
            return text if any(v >= 2 for v in verdict.values()) else None
        text = wait_for(named, 300, interval=0.5, what="TrainingReplicaDivergence's series")
        verdict = _series(text, "trainwatch_replica_divergence_digests")
        assert all('suspects="1"' in labels for labels in verdict), verdict
        mismatch = _series(text, "trainwatch_replica_digest_mismatch")
        by_rank = {re.search(r'rank="(\d+)"', k).group(1): v for k, v in mismatch.items()}
        assert by_rank["1"] >= 2 and by_rank["0"] == by_rank["2"] == 0, by_rank
        code, out = finish(proc)
        assert code == 0, out[-3000:]
        status = json.loads(http_get(url + "/status"))
        group = status["jobs"][0]["replica_groups"]["0"]
        assert group["suspects"] == [1] and group["majority"], group
    finally:
        stop_process(agent)
    # From the files: every digest before the fault agrees; every one after it differs on
    # rank 1 only, from the first digest after the fault (within EVERY steps).
    digests = {}
    for rank in range(3):
        s = json.loads((run_dir / "status" / f"rank-{rank:05d}.json").read_text())
        digests[rank] = {d["step"]: d["bits"] for d in s["replicas"]}
    steps = sorted(digests[0])
    assert steps == list(range(STEPS - 8 * EVERY + EVERY - 1, STEPS, EVERY))
    for step in steps:
        assert digests[0][step] == digests[2][step]
        assert (digests[1][step] != digests[0][step]) == (step >= FAULT_STEP), step
    first_odd = min(s for s in steps if digests[1][s] != digests[0][s])
    assert first_odd - FAULT_STEP < EVERY
    # What the runbook's first command (trainwatch diagnose) tells the on-call.
    code, report, _ = diagnose(RunDir(run_dir))
    found = top(report, "replica_divergence")
    assert code == 1 and found["ranks"] == [1] and found["severity"] == "critical", found
    assert found["confidence"] == "high" and f"since step {first_odd}" in found["evidence"][-1]


def _final_digests(run_dir) -> dict[int, str]:
    out = {}
    for rank in range(3):
        s = json.loads((run_dir / "status" / f"rank-{rank:05d}.json").read_text())
        out[rank] = s["replicas"][-1]
        assert out[rank]["step"] == 59, s["replicas"]
    return {rank: d["bits"] for rank, d in out.items()}


def test_drill_rolls_back_to_the_last_agreeing_checkpoint_and_ends_as_a_clean_run(
        tmp_path, launch_train):
    """`trainwatch run` (agent, engine, controller) around 3 ranks: rank 1's weight is
    corrupted after step 22 of the first start, which then waits at step 45. The alert's
    replica_rollback stops the job, quarantines the checkpoints saved after the last
    agreeing digest (19: checkpoints 30 and 40, those saved by then), resumes from 20, and
    the run ends with the very weights of a clean run."""
    import os
    import subprocess
    import sys

    from control_helpers import _finish

    (tmp_path / "thresholds.yaml").write_text("evaluation_interval: 1s\nstall_min_seconds: 600\n")
    (tmp_path / "agent.yaml").write_text(
        "collectors:\n  ranks: {interval: 0.5}\n  replicas: {interval: 0.5}\n")
    (tmp_path / "train.yaml").write_text(
        "train: {steps: 60, batch_size: 4, eval_interval: 1000}\n"
        "data: {corpus_bytes: 200000}\n"
        f"telemetry: {{heartbeat_interval: 0.2, replica_every: {EVERY}}}\n"
        "checkpoint: {every_steps: 10, mode: sync, fsync: false, keep_last: 10}\n")
    # The clean run resumes from checkpoint 20 too (rank 0 exits at step 25, torchrun
    # restarts it): gloo's 3-way sums round by where an element falls in DDP's buckets,
    # which are laid out afresh by each start, so only a run started at 20 is bitwise alike.
    clean_dir = tmp_path / "clean"
    code, out = finish(launch_train("--nproc-per-node", "3", "--run-dir", str(clean_dir),
                                    "--config", str(tmp_path / "train.yaml"),
                                    "--max-restarts", "1",
                                    env={"TRAINWATCH_FAULT": "exit:rank=0:step=25"}))
    assert code == 0, out[-3000:]
    clean = _final_digests(clean_dir)
    assert len(set(clean.values())) == 1

    run = RunDir(tmp_path / "exp")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainwatch", "run", "--nproc-per-node", "3", "--run-dir",
         str(run.root), "--config", str(tmp_path / "train.yaml"), "--thresholds",
         str(tmp_path / "thresholds.yaml"), "--agent-config", str(tmp_path / "agent.yaml"),
         "--no-live"], stdout=open(tmp_path / "run.log", "wb"), stderr=subprocess.STDOUT,
        env={**os.environ, "TMPDIR": str(scratch), "OMP_NUM_THREADS": "1",
             "TRAINWATCH_FAULT": "sdc:rank=1:step=22:launch=1,"
                                 "sleep:step=45:seconds=240:launch=1"})
    assert _finish(proc, timeout=400) == 0, (tmp_path / "run.log").read_text()[-3000:]

    firing = [e for e in run.events("alert_firing") if e["alert"] == "TrainingReplicaDivergence"]
    assert firing and firing[0]["labels"]["suspects"] == "1", firing
    taken = run.events("action_taken")
    assert [t["action"] for t in taken] == ["replica_rollback"], taken
    assert taken[0]["divergence"]["first_odd_step"] == 24
    assert taken[0]["divergence"]["last_agreeing_step"] == 19
    assert taken[0]["clean_checkpoint_step"] == 20
    assert [s["rank"] for s in taken[0]["suspects"]] == [1]
    # Every checkpoint saved after the last agreeing digest, as many as the job had saved
    # when the alert acted (30 and 40 on an idle machine; a loaded one acts sooner).
    quarantined = {q["step"] for q in taken[0]["quarantined"]}
    saved_after = {s for s in (30, 40) if s <= taken[0]["step_before"]}
    assert saved_after <= quarantined <= {30, 40}, (quarantined, taken[0]["step_before"])
    resumed = run.events("checkpoint_resumed")
    assert [r["step"] for r in resumed] == [20]
    assert _final_digests(run.root) == clean
