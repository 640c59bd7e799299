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
# With no arguments (CI): lint and type-check the whole tree (pyproject.toml), then the
# whole suite on two workers, a test file per worker (most end-to-end tests wait on real
# processes; a file's module fixtures start their runs once). With arguments: just pytest.
if [ $# -eq 0 ]; then
    ruff check .
    mypy
    exec python -m pytest -q -n 2 --dist loadfile --durations=15
fi
python -m pytest -q "$@"
