"""The checkpoints a run's job declared itself, and every checkpoint of a run.

``tel.checkpoint_saved(path, step)`` journals ``checkpoint_saved`` with ``declared: true``,
the resolved ``path`` and ``step`` (trainwatch/rank/telemetry.py). A declared directory
that DCP wrote is a checkpoint wherever it lies, in a checkpoint folder or not: the
summary and ``trainwatch checkpoint list`` show it as one.
"""

from __future__ import annotations

import logging
from pathlib import Path

from trainwatch.checkpoint_format.catalog import Entry, dcp_entry, ordered, resolved, scan
from trainwatch.rundir.run_dir import RunDir

log = logging.getLogger(__name__)


def declared_steps(run: RunDir) -> dict[Path, int]:
    """{path: step} of every checkpoint the job declared, with its newest step (a
    directory saved over and over counts once). Empty when the journal cannot be read."""
    try:
        events = run.events("checkpoint_saved")
    except Exception:  # a reader of a broken run directory says less, it does not fail
        log.debug("the journal could not be read", exc_info=True)
        return {}
    found: dict[Path, int] = {}
    for event in events:
        step, path = event.get("step"), event.get("path")
        if not event.get("declared") or type(step) is not int or not isinstance(path, str):
            continue
        found[Path(path)] = max(step, found.get(Path(path), step))
    return found


def run_checkpoints(run: RunDir, folders: list[Path] | None = None) -> list[Entry]:
    """Every checkpoint-like directory of ``run``: its checkpoint folders' (``folders``,
    default: where run.json says), and the DCP checkpoints the job declared elsewhere;
    checkpoints newest first, then the rest (``catalog.ordered``)."""
    declared = declared_steps(run)
    folders = run.checkpoint_folders() if folders is None else folders
    entries = [e for folder in folders for e in scan(folder, declared)]
    seen = {resolved(e.path) for e in entries}
    for path, step in sorted(declared.items()):
        if resolved(path) in seen or not path.is_dir():
            continue
        found = dcp_entry(path, step, declared=True)
        if found is not None:
            entries.append(found)
    return ordered(entries)
