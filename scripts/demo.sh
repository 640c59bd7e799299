#!/usr/bin/env bash
# Set up a virtual environment with trainwatch, then a short 2-rank reference training run watched by the agent and the alert engine.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q torch==2.13.0 numpy
pip install -q -e .
trainwatch run --nproc-per-node 2 --run-dir runs/demo --steps 300 "$@"
