"""The reference trainer on CUDA (NCCL, bf16 autocast, MFU); runs only where a GPU is."""

import subprocess
import sys

import pytest
import torch

from trainwatch.rundir.run_dir import RunDir

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_trainer_runs_on_cuda_with_nccl_and_reports_mfu(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "trainwatch", "train", "--nproc-per-node", "1",
                           "--run-dir", str(run_dir), "--steps", "60",
                           "--set", "train.eval_interval=30"],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    status = RunDir(run_dir).statuses().records[0]
    assert status["state"] == "finished" and status["backend"] == "nccl"
    assert status["device"].startswith("cuda")
    metrics = status["metrics"]
    assert metrics["memory_kind"] == "cuda_peak_allocated" and metrics["memory_bytes"] > 0
    # Phase times are CUDA-event device times; MFU is known for the GPUs in trainer/flops.py.
    assert metrics["phase_seconds"]["forward"] > 0
    if metrics["mfu"] is not None:
        assert 0 < metrics["mfu"] < 1
    steps = [r for r in RunDir(run_dir).metrics(0).records if r["kind"] == "step"]
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.0
