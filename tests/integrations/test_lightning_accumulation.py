"""Lightning with ``accumulate_grad_batches``: a trainwatch step is an optimizer step (the
framework's ``global_step``), as docs/own-trainer.md asks of any loop. Each batch used to be
a step: every step number came N times (steps/s and step time off by N, samples per step a
micro-batch's), and a due checkpoint was written again at every micro-batch of the next
step: ``step-0`` before any optimizer step, ``step-5`` N times, the last copy
mid-accumulation."""

import pytest

from framework_helpers import fit
from trainwatch.rundir.run_dir import RunDir

ACCUMULATE, BATCH, STEPS, EVERY = 4, 4, 12, 5


def test_a_step_is_an_optimizer_step_and_each_due_save_is_written_once(tmp_path):
    L = pytest.importorskip("lightning")
    import torch

    from trainwatch.integrations.lightning import TrainwatchCallback

    run = RunDir(tmp_path / "run")
    trainer = fit(L, torch, TrainwatchCallback(run.root, every_steps=EVERY), STEPS,
                  accumulate=ACCUMULATE, batch=BATCH)

    assert trainer.global_step == STEPS
    steps = [r for r in run.metrics(0).records if r.get("kind") == "step"]
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert {r["samples"] for r in steps} == {ACCUMULATE * BATCH}
    assert all(set(r["phase_seconds"]) >= {"forward", "backward", "optimizer"} for r in steps)
    saved = [e["step"] for e in run.events("checkpoint_saved")]
    assert saved == [5, 10], saved
    state = torch.load(run.checkpoint_dir / "step-00000005" / "lightning.ckpt",
                       weights_only=False)
    assert state["global_step"] == 5
    loop = state["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]
    assert loop["processed"] == 5 * ACCUMULATE  # at the optimizer step, not inside the next
