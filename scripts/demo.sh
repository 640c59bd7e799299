#!/usr/bin/env bash
# Set up a virtual environment with trainwatch, then a short 2-rank reference training run
# watched by the agent and the alert engine; it ends with a summary and the next commands,
# printed so that they run as printed in a new shell (.venv/bin/trainwatch, no activation).
# TRAINWATCH_DEMO_STEPS (default 300) sets the run's length; another length is another
# experiment (the learning-rate schedule spans the steps), so it gets its own run
# directory, runs/demo-STEPS. TRAINWATCH_DEMO_SKIP_SETUP=1 uses the trainwatch already on
# PATH instead of setting up .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${TRAINWATCH_DEMO_STEPS:-300}"
run_dir=runs/demo
[ "$steps" = 300 ] || run_dir="runs/demo-$steps"
trainwatch=trainwatch
if [ -z "${TRAINWATCH_DEMO_SKIP_SETUP:-}" ]; then
    python3 -m venv .venv
    .venv/bin/pip install -q --upgrade pip
    .venv/bin/pip install -q torch==2.13.0 numpy
    .venv/bin/pip install -q -e '.[html]'   # the summary's `report --html` draws with plotly
    trainwatch=.venv/bin/trainwatch
fi
"$trainwatch" run --nproc-per-node 2 --run-dir "$run_dir" --steps "$steps" "$@"
