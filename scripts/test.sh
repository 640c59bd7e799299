#!/usr/bin/env bash
# Set up a virtual environment with trainwatch and its test dependencies, then run the tests.
# torch is pinned to the CPU wheel here; GPU users install their own CUDA build first.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q torch==2.13.0 numpy
pip install -q -e '.[test]'
# With no arguments (CI), lint and type-check the whole tree first (pyproject.toml).
if [ $# -eq 0 ]; then
    ruff check .
    mypy
fi
python -m pytest -q "$@"
