"""Where a drill keeps its record in the run directory, and the record's format: shared by
the runner that writes it and the scorer that reads it (which must not import torch)."""

from __future__ import annotations

from pathlib import Path

from trainwatch.rundir.run_dir import RunDir

RECORD_FORMAT = "trainwatch.drill.record"
RECORD_VERSION = 1


def record_file(run: RunDir) -> Path:
    return run.drill_dir / "drill.json"
