"""NaN at a known batch -> TrainingLossNonFinite -> roll back and skip -> finite finish.

All real: `trainwatch run` (the agent, the embedded engine, the controller, the
supervisor) around `trainwatch train` with two gloo ranks under torchrun and the
checkpoint library.  TRAINWATCH_FAULT makes the loss of step 24 NaN on every start of
the job (a batch corrupt on disk: each controller restart is a fresh torchrun), and
parks the ranks at step 25 so the first attempt cannot finish on its own; only
dropping the batches of steps 21-25 (control/skip-steps.json) lets the run finish.
"""

import importlib.util
import math

import pytest

from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.jsonl import read_jsonl

from control_helpers import _finish, _run

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("trainwatch.agent.daemon") is None
    or importlib.util.find_spec("trainwatch.rank.checkpoint") is None,
    reason="needs the agent and the checkpoint library")]


def test_nan_batch_is_rolled_back_skipped_and_the_run_finishes(tmp_path):
    # The job sleeps at step 25 to hold it for the rollback; keep the stall alerts out of
    # this test, or a loaded machine may see the stall before the NaN (both act: see
    # test_alert_actions's rollback-after-restart test).
    (tmp_path / "thresholds.yaml").write_text(
        "evaluation_interval: 1s\nskip_window_steps: 1\nstall_min_seconds: 600\n")
    (tmp_path / "agent.yaml").write_text("collectors:\n  ranks: {interval: 0.5}\n")
    # Sync saves: checkpoint 25 (after the NaN) is complete before step 25 starts.
    (tmp_path / "train.yaml").write_text(
        "train: {steps: 60, batch_size: 4, eval_interval: 1000}\n"
        "data: {corpus_bytes: 200000}\ntelemetry: {heartbeat_interval: 0.2}\n"
        "checkpoint: {every_steps: 5, mode: sync, fsync: false, keep_last: 10}\n")
    run = RunDir(tmp_path / "exp1")
    proc = _run(tmp_path, run.root,
                env={"TRAINWATCH_FAULT": "nan:step=24,sleep:step=25:seconds=240"})
    assert _finish(proc, timeout=300) == 0, (tmp_path / "run.log").read_text()[-3000:]

    firing = run.events("alert_firing")
    assert firing[0]["alert"] == "TrainingLossNonFinite"
    taken = run.events("action_taken")
    assert len(taken) == 1 and taken[0]["action"] == "rollback_skip", taken
    assert taken[0]["bad_step"] == 24 and taken[0]["resume_step"] == 20
    assert taken[0]["skip"]["from_step"] == 21 and taken[0]["skip"]["to_step"] == 25
    assert {q["step"] for q in taken[0]["quarantined"]} == {25}
    # nan and sleep fired on both ranks of the first start; the second never ran 24 or 25.
    injected = run.events("fault_injected")
    assert sorted((e["fault"], e["step"]) for e in injected) == [("nan", 24), ("nan", 24),
                                                                  ("sleep", 25), ("sleep", 25)]
    skipped = run.events("data_skipped")
    assert len(skipped) == 1 and skipped[0]["steps"] == [21, 22, 23, 24, 25]
    assert skipped[0]["batches_per_rank"] == 5
    assert skipped[0]["data_to"]["position"] - skipped[0]["data_from"]["position"] == 5
    resumed = run.events("checkpoint_resumed")
    assert len(resumed) == 1 and resumed[0]["step"] == 20
    finished = run.events("finished")  # only the rolled-back start got to the end
    assert len(finished) == 1 and finished[0]["step"] == 59
    last = [r for r in run.metrics(0).records if r.get("kind") == "step"][-1]
    assert last["step"] == 59 and math.isfinite(last["loss"])
    trained = [r["step"] for r in read_jsonl(run.metrics_file(0)).records
               if r.get("kind") == "step"]
    assert trained == list(range(25)) + [20] + list(range(26, 60))
    names = [e["event"] for e in run.events()]
    firsts = [names.index(n) for n in ("nonfinite_detected", "alert_firing", "action_taken",
                                       "checkpoint_resumed", "data_skipped", "finished")]
    assert firsts == sorted(firsts)
