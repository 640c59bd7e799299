"""trainwatch plan against what the reference trainer really takes: checkpoint bytes of a real
run (within 1 %), peak memory on the CPU (and on a GPU when there is one)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

JOB = str(REPO / "tests" / "jobs" / "plan_memory_job.py")
# A config unlike the defaults, so nothing in the formula can be a constant in disguise.
SHAPE = ["model.layers=3", "model.width=96", "model.heads=3", "model.context=32",
         "train.batch_size=4"]
# Stated tolerance of the memory estimate: it is an upper bound (weights, gradients, optimizer
# state and every activation at once) that backward never quite reaches.
MEMORY_LOW, MEMORY_HIGH = 0.75, 1.05


def plan_json(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "trainwatch", "plan", "--json", *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.slow
def test_checkpoint_bytes_match_a_real_runs_checkpoint_within_1_percent(tmp_path):
    run = tmp_path / "run"
    sets = [a for s in SHAPE + ["train.steps=2", "checkpoint.fsync=false"] for a in ("--set", s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRAINWATCH_FAULT", None)
    done = subprocess.run([sys.executable, "-m", "trainwatch", "train", "--nproc-per-node", "2",
                           "--run-dir", str(run), *sets], capture_output=True, text=True,
                          timeout=240, env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    [step_dir] = (run / "checkpoints").glob("step-*")
    real = sum(f.stat().st_size for f in step_dir.iterdir())
    estimate = plan_json(*sets, "--devices", "2", "--device-type", "cpu")
    assert estimate["storage"]["checkpoint_bytes"] == pytest.approx(real, rel=0.01)


@pytest.mark.slow
def test_memory_estimate_is_within_tolerance_of_the_measured_cpu_peak():
    sets = ["model.layers=4", "model.width=256", "model.context=128", "train.batch_size=16",
            "train.device=cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run([sys.executable, JOB, *sets], capture_output=True, text=True,
                          timeout=240, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["measured"] is not None, "the warm-up peaked higher than the measured steps"
    ratio = out["measured"] / out["estimate"]["total_bytes"]
    assert MEMORY_LOW <= ratio <= MEMORY_HIGH, out


@pytest.mark.gpu
def test_memory_estimate_against_cuda_max_memory_allocated():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    sets = ["model.layers=8", "model.width=1024", "model.heads=8", "model.context=1024",
            "train.batch_size=8", "train.device=cuda"]
    done = subprocess.run([sys.executable, JOB, *sets], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    print("GPU memory: measured", out["measured"], "estimate", out["estimate"])
    ratio = out["measured"] / out["estimate"]["total_bytes"]
    assert MEMORY_LOW <= ratio <= MEMORY_HIGH, out
