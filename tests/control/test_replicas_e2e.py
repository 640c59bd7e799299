"""Silent data corruption, for real: a 3-rank torchrun gloo job of the reference trainer
flips one bit of one weight on rank 1 mid-run (TRAINWATCH_FAULT=sdc:...); its agent names
rank 1 within two digests, and the ranks' digests before the fault agree.

The repair (the alert's replica_rollback under `trainwatch run`, ending with a clean run's
weights) is proven by the sdc drill: tests/drill/test_drill.py."""

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
