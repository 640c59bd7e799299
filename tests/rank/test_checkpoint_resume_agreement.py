"""Two ranks agree on the checkpoint to resume in one gather, and fall back together.

Before: rank 0 sent each candidate, gathered every rank's problems, told the others it was
done, then broadcast its decision (four collectives for a checkpoint that verified), and a
sharded resume took each model's and optimizer's DCP state dict apart. Now every rank
hashes its share and one all-gather gives every rank the verdict and rank 0's decision
(parallel_verify.py). Here a real 2-rank torchrun job (tests/jobs/
sharded_resume_agreement_job.py): a byte of rank 1's shard of the newest checkpoint is
flipped, which only rank 1 hashes; both ranks pass it over and resume the one before,
with its weights, and a checkpoint of another config is refused on both ranks alike."""

import json
from pathlib import Path

from conftest import run_torchrun
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
    refused = {r["refused"] for r in ranks}
    assert len(refused) == 1 and "another-config" in refused.pop()
    run = RunDir(out / "run")
    (fallback,) = {e["path"]: e for e in run.events("checkpoint_fallback")}.values()
    assert fallback["path"].endswith("step-00000002")
    assert fallback["next"].endswith("step-00000001")
    assert fallback["reason"] == "__1_0.distcp: xxh3_128 mismatch (content changed or corrupt)"
