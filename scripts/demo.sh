#!/usr/bin/env bash
# Set up a virtual environment with trainwatch, then run a short 2-rank reference training run.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q torch==2.13.0 numpy
pip install -q -e .
trainwatch train --nproc-per-node 2 --run-dir runs/demo --steps 200 "$@"
