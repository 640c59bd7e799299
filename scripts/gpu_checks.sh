#!/usr/bin/env bash
# The GPU checks, as one short script for a machine with an NVIDIA GPU (the project's lent
# accelerator, or any GPU node). Writes every log to $OUT (default ./gpu-checks).
#
# On the lent H200 (Python 3.12 with torch, nvidia-ml-py, prometheus-client, psutil, click,
# rich, PyYAML and pytest already there; no network), first fetch the few missing wheels here:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux2014_x86_64 -d .whl \
#       'apscheduler==3.11.*' 'tzlocal==5.*' 'setuptools>=77'
# then run it with `.whl` carried: bash scripts/gpu_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-checks}"
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/tw . \
        || { echo "could not install trainwatch" >&2; exit 1; }
    export PYTHONPATH=/tmp/tw:/tmp/site
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0), 'nccl', torch.cuda.nccl.version())"; } 2>&1 | tee "$OUT/machine.txt"
# 1. every GPU test: the real NVML collector, CUDA event timing, NCCL groups, pinned snapshots
python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest-gpu.txt"
# 2. the agent's GPU collector against the real NVML: its state and the first samples
python3 - <<'PY' 2>&1 | tee "$OUT/agent-nvml.txt"
import tempfile
import trainwatch.agent.collectors  # noqa: F401 - registers them
from trainwatch.agent.config import load_config
from trainwatch.agent.context import AgentContext
from trainwatch.agent.registry import all_collectors
ctx = AgentContext(load_config(None, run_dirs=[tempfile.mkdtemp()]))
spec = all_collectors()["gpu"]
result = spec.factory(ctx, ctx.config.collector("gpu")).collect()
print("state", result.state, "reason", result.reason)
for s in sorted(result.samples, key=lambda s: s.name)[:80]:
    print(s.name, s.labels, s.value)
PY
# 3. telemetry overhead on CUDA (one process)
python3 benchmarks/telemetry_overhead.py 2>&1 | tee "$OUT/telemetry-overhead.txt"
# 4. trainwatch plan's memory estimate against torch.cuda.max_memory_allocated (for the README)
python3 tests/jobs/plan_memory_job.py model.layers=8 model.width=1024 model.heads=8 \
    model.context=1024 train.batch_size=8 train.device=cuda 2>&1 | tee "$OUT/plan-memory.txt"
echo "done; logs in $OUT"
