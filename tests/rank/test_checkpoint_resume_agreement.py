"""Two ranks agree on the checkpoint to resume in one gather, and fall back together.

Before: rank 0 sent each candidate, gathered every rank's problems, told the others it was
done, then broadcast its decision (four collectives for a checkpoint that verified), and a
sharded resume took each model's and optimizer's DCP state dict apart. Now every rank
hashes its share and one all-gather gives every rank the verdict and rank 0's decision
(parallel_verify.py). Here a real 2-rank torchrun job (tests/jobs/
sharded_resume_agreement_job.py): a byte of rank 1's shard of the newest checkpoint is
flipped, which only rank 1 hashes; both ranks pass it over and resume the one before,
with its weights and the rollback's skip window (which comes with the decision: no
broadcast of its own), and a checkpoint of another config is refused on both ranks
alike. In one process: the skip request read with the decision, and its error."""

import json
from pathlib import Path

import pytest
import torch

from conftest import run_torchrun
from trainwatch import Checkpoints
from trainwatch.errors import ConfigError
from trainwatch.rank.checkpoint import checkpoints as checkpoints_mod
from trainwatch.rundir.run_dir import RunDir

JOB = Path(__file__).resolve().parents[1] / "jobs" / "sharded_resume_agreement_job.py"


def test_a_bad_shard_only_rank_1_hashes_makes_both_ranks_resume_the_one_before(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    done = run_torchrun(tmp_path, str(JOB), str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [r["resumed"] for r in ranks] == [1, 1]
    assert all(r["weights_of_step_1"] for r in ranks)
    assert [r["skipped"] for r in ranks] == [[5, 6], [5, 6]]
    refused = {r["refused"] for r in ranks}
    assert len(refused) == 1 and "another-config" in refused.pop()
    run = RunDir(out / "run")
    (fallback,) = {e["path"]: e for e in run.events("checkpoint_fallback")}.values()
    assert fallback["path"].endswith("step-00000002")
    assert fallback["next"].endswith("step-00000001")
    assert fallback["reason"] == "__1_0.distcp: xxh3_128 mismatch (content changed or corrupt)"


def test_the_skip_request_comes_with_the_decision_and_its_error_stops_the_resume(
        tmp_path, monkeypatch):
    run = RunDir(tmp_path / "run")
    model = torch.nn.Linear(4, 2)
    ckpt = Checkpoints.from_env(run.root, every_steps=2, mode="sync", fsync=False)
    ckpt.maybe_save(2, model=model)
    ckpt.close(final=False)
    run.skip_steps_file.write_text(json.dumps({"from_step": 3, "to_step": 4}))

    def no_collective(*_):
        raise AssertionError("the skip window was agreed apart")

    monkeypatch.setattr(checkpoints_mod, "agree_skip_steps", no_collective)
    again = Checkpoints.from_env(run.root, fsync=False)
    assert again.resume(model=model) == 2
    assert [s for s in range(6) if again.should_skip(s)] == [3, 4]
    again.close(final=False)

    run.skip_steps_file.write_text(json.dumps({"from_step": -1, "to_step": 4}))
    bad = Checkpoints.from_env(run.root, fsync=False)
    with pytest.raises(ConfigError) as error:
        bad.resume(model=model)
    assert error.value.file == str(run.skip_steps_file) and error.value.key == "from_step"
    bad.close(final=False)
