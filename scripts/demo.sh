#!/usr/bin/env bash
# Set up a virtual environment with trainwatch, then a short 2-rank reference training run
# watched by the agent and the alert engine; it ends with a summary and the next commands.
# TRAINWATCH_DEMO_STEPS (default 300) sets the run's length; TRAINWATCH_DEMO_SKIP_SETUP=1
# uses the trainwatch already on PATH instead of setting up .venv (the test suite does).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${TRAINWATCH_DEMO_SKIP_SETUP:-}" ]; then
    python3 -m venv .venv
    . .venv/bin/activate
    pip install -q --upgrade pip
    pip install -q torch==2.13.0 numpy
    pip install -q -e .
fi
trainwatch run --nproc-per-node 2 --run-dir runs/demo --steps "${TRAINWATCH_DEMO_STEPS:-300}" "$@"
