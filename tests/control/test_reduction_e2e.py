"""A wrong all-reduce, for real: a 2-rank torchrun gloo job of the reference trainer has
rank 1's contribution to a gradient bucket corrupted in step 29's all-reduce, after its
checksum was taken (TRAINWATCH_FAULT=reduce:...). Both ranks apply the same wrong gradient,
so their parameter digests agree; the reduction checksum catches it: in the ranks' status
and metrics logs, in the agent's /metrics, and TrainingReductionChecksumMismatch fires."""

import json
import re
import time

import pytest

from agent_helpers import http_get, start_agent, stop_process, wait_for
from conftest import finish
from diagnose_helpers import diagnose, top
from trainwatch.alerts.engine import Engine
from trainwatch.alerts.evaluate import History
from trainwatch.alerts.rules import load_rules
from trainwatch.alerts.scrape import Scraper
from trainwatch.rundir.run_dir import RunDir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EVERY, FAULT_STEP, STEPS = 5, 29, 45
MISMATCHES = "trainwatch_rank_reduction_checksum_mismatches_total"


def _by_rank(text: str, name: str) -> dict[str, float]:
    return {re.search(r'rank="(\d+)"', labels).group(1): float(value) for labels, value in
            re.findall(rf"^{name}{{([^}}]*)}} (\S+)$", text, re.M)}


def test_a_corrupted_reduction_is_recorded_exported_and_alerted(tmp_path, launch_train):
    run_dir = tmp_path / "exp"
    RunDir(run_dir).create()
    agent, url = start_agent(tmp_path, "--run-dir", str(run_dir))
    try:
        proc = launch_train(
            "--nproc-per-node", "2", "--run-dir", str(run_dir), "--steps", str(STEPS),
            "--set", f"telemetry.reduction_every={EVERY}",
            "--set", f"telemetry.replica_every={EVERY}", "--set", "train.eval_interval=1000",
            "--set", "telemetry.heartbeat_interval=0.2",
            env={"TRAINWATCH_FAULT": f"reduce:rank=1:step={FAULT_STEP},slow:delay=0.15"})
        history = History()
        engine = Engine(load_rules(), history)
        scraper = Scraper(history, [url])

        def exported():
            counts = _by_rank(http_get(url + "/metrics").decode(), MISMATCHES)
            return counts if counts == {"0": 1.0, "1": 1.0} else None
        wait_for(exported, 300, interval=0.5, what="both ranks' mismatch counted in /metrics")

        def fired():
            now = time.time()
            scraper.scrape_all(now)
            engine.evaluate(now)
            return [a for a in engine.firing() if a.name == "TrainingReductionChecksumMismatch"]
        [alert] = wait_for(fired, 30, interval=0.5, what="TrainingReductionChecksumMismatch")
        assert alert.labels["run"] == "exp" and alert.labels["severity"] == "warning"
        assert alert.value == 2  # both ranks received the wrong bucket
        assert not [a for a in engine.firing() if a.name == "TrainingReplicaDivergence"]
        code, out = finish(proc)
        assert code == 0, out[-3000:]
        assert "injecting fault reduce" in out
    finally:
        stop_process(agent)
    digests = {}
    for rank in range(2):
        s = json.loads((run_dir / "status" / f"rank-{rank:05d}.json").read_text())
        assert s["counters"]["reduction_mismatches_total"] == 1, s["reduction"]
        [mismatch] = s["reduction"]["mismatches"]
        assert mismatch["step"] == FAULT_STEP
        assert abs(mismatch["reduced_sum"] - mismatch["expected_sum"]) > mismatch["tolerance"]
        assert s["reduction"]["step"] == STEPS - 1
        digests[rank] = [(d["step"], d["bits"]) for d in s["replicas"]]
        logged = [json.loads(line) for line in
                  (run_dir / "metrics" / f"rank-{rank:05d}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in logged if r["kind"] == "reduction"] == [FAULT_STEP]
    # Every replica applied the same wrong gradient: their digests agree, before and after.
    assert digests[0] == digests[1]
    # What the runbook's first command (trainwatch diagnose) tells the on-call.
    code, report, _ = diagnose(RunDir(run_dir))
    found = top(report, "reduction_mismatch")
    assert code == 1 and found["ranks"] == [0, 1] and f"step(s) {FAULT_STEP}" in found["title"]
    assert f"checkpoints up to step {FAULT_STEP}" in found["next_command"]
    assert "replica_divergence" not in [f["category"] for f in report["findings"]]
    assert [step for step, _ in digests[0]] == list(range(STEPS - 8 * EVERY + EVERY - 1, STEPS,
                                                          EVERY))


def test_a_reduce_fault_without_the_check_is_bad_input_not_a_fault_that_never_fires(
        tmp_path, launch_train):
    run_dir = tmp_path / "exp"
    proc = launch_train("--nproc-per-node", "1", "--run-dir", str(run_dir), "--steps", "5",
                        "--max-restarts", "0", "--set", "telemetry.reduction_every=0",
                        env={"TRAINWATCH_FAULT": "reduce:step=3",
                             "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    code, out = finish(proc)
    assert code != 0 and "key 'reduce': a reduce fault needs the reduction check" in out, out
    status = json.loads((run_dir / "status" / "rank-00000.json").read_text())
    assert status["state"] == "failed" and status["reduction"] is None
    assert "exitcode: 2" in out
