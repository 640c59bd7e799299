"""Resume from the newest snapshot every rank has, when it is newer than the durable one.

Every rank lists its sealed snapshots (headers only) of this world size and config, the
ranks agree on the newest common step (agree.py), each rank then reads its file of that
step once, checks its digest and loads it; if any rank's file fails, that step is dropped
and the next common one tried. Data-parallel state may resume from a newer step that a
replica's dying gasp holds whole and every rank holds its own part of (gasp_resume.py).
The result is a ``Restored`` like a durable checkpoint's, so the loop puts it back the
same way.
"""

from __future__ import annotations

import io
import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch

from trainwatch.rank.checkpoint.resume import Restored
from trainwatch.rank.memory_snapshots import gasp_resume, payload, shards, store
from trainwatch.rank.memory_snapshots.agree import (ROLLBACK_ACTIONS, Agreed, Found, gather,
                                                     newest_common)
from trainwatch.rank.memory_snapshots.snapshotter import MemorySnapshots
from trainwatch.rundir.run_dir import RunDir

log = logging.getLogger(__name__)

SOURCE = "memory snapshot"


def found_here(snaps: MemorySnapshots) -> Found:
    """This rank's usable snapshots: sealed, of this world size and config."""
    found = Found(snaps.rank)
    if snaps.folder is None:
        return found
    for s in store.sealed(snaps.folder):
        if s.rank != snaps.rank or s.world_size != snaps.world_size:
            found.refused.append(f"{s.path.name} is of rank {s.rank} at world size "
                                 f"{s.world_size}, this job's rank {snaps.rank} at "
                                 f"{snaps.world_size}: another world size resumes from "
                                 "the durable checkpoint")
        elif s.config_hash != snaps.config_hash:
            found.refused.append(f"{s.path.name}: written by another config")
        else:
            found.steps[s.step] = s.sealed_at or 0.0
    return found


def rollback_at(run: RunDir) -> float | None:
    """When the controller last rolled the job back (rank 0 reads the journal once)."""
    try:
        times = [e["time"] for e in run.events("action_taken")
                 if e.get("action") in ROLLBACK_ACTIONS and isinstance(e.get("time"), (int, float))]
    except Exception as exc:  # an unreadable journal: no rollback known
        log.warning("trainwatch memory snapshots: cannot read the journal: %s", exc)
        return None
    return max(times, default=None)


def found_mine(snaps: MemorySnapshots, run: RunDir, durable_step: int | None,
               live: Callable[[], Any] | None) -> Found:
    """What this rank tells the others to agree on: its snapshots (and, of data-parallel
    state, its dying gasps' parts); rank 0 adds the durable step and the last rollback."""
    mine = found_here(snaps)
    if live is None and snaps.root is not None:  # data parallel: dying gasps
        gasp_resume.found_parts(mine, snaps.root, snaps.rank, snaps.world_size,
                                snaps.config_hash)
    if snaps.rank == 0:
        mine.durable_step, mine.rollback_at = durable_step, rollback_at(run)
    return mine


def resume(snaps: MemorySnapshots, run: RunDir, durable_step: int | None,
           live: Callable[[], Any] | None = None, found: list[Found] | None = None
           ) -> tuple[Restored | None, str]:
    """Every rank: the agreed snapshot loaded, or None; and the reason (journaled).
    ``live``: the job's state trees holding its DTensors (None: not sharded), called only
    when a sharded snapshot is to be checked and loaded. ``found``: every rank's
    ``found_mine``, gathered already (with ``prepare``'s gather: one collective less)."""
    snaps.prepare()
    if not snaps.enabled:
        return None, f"memory snapshots are off: {snaps.facts['off_reason']}"
    replicated = live is None and snaps.root is not None  # data parallel: dying gasps
    if found is None:
        found = gather(found_mine(snaps, run, durable_step, live), snaps.group,
                       snaps.world_size)
    excluded: set[int] = set()
    while True:
        agreed = newest_common(found, frozenset(excluded))
        chosen = (gasp_resume.plan(found, frozenset(excluded), agreed.step)
                  if replicated else None)
        if chosen is not None:  # newer than every rank's snapshot: a gasp stands in
            assert snaps.root is not None
            agreed = Agreed(chosen.step, chosen.reason)
            restored, problem = gasp_resume.load(snaps.root, snaps.rank, chosen,
                                                 snaps.world_size, load_file)
        elif agreed.step is None:
            return None, agreed.reason
        else:
            restored, problem = _load(snaps, agreed.step)
        assert agreed.step is not None
        if restored is not None:
            problem = check_fit(restored, live)
        problems = gather(problem, snaps.group, snaps.world_size)
        misfit = misfit_reason(agreed.step, problems)
        if misfit is not None:  # an older snapshot of the same job would not fit either
            return None, misfit
        bad = {r: p for r, p in enumerate(problems) if p is not None}
        if not bad:
            assert restored is not None
            newest = max((s for f in found for s in f.steps), default=agreed.step)
            restored.manifest.update(newest_step=max(newest, agreed.step),
                                     steps_lost=max(newest, agreed.step) - agreed.step)
            snaps.resumed(agreed.step)
            return restored, agreed.reason
        if snaps.rank == 0:
            snaps.journal("memory_snapshot_rejected", step=agreed.step,
                           ranks={str(r): p for r, p in sorted(bad.items())[:8]})
        excluded.add(agreed.step)


MISFIT = "misfit: "


def misfit_reason(step: int, problems: list[str | None]) -> str | None:
    """Why no rank resumes from memory when any rank's snapshot did not fit (the first
    such rank's reason), else None."""
    misfits = {r: p[len(MISFIT):] for r, p in enumerate(problems)
               if p is not None and p.startswith(MISFIT)}
    if not misfits:
        return None
    first = min(misfits)
    return (f"step {step}'s snapshot does not fit this job's sharded state (rank {first}: "
            f"{misfits[first]}); the durable checkpoint reshards")


def check_fit(restored: Restored, live: Callable[[], Any] | None) -> str | None:
    """None when the snapshot fits the job's state (its shards, if sharded, made DTensors
    on the job's mesh, in place in ``restored``); else why not, prefixed ``MISFIT``."""
    record = restored.manifest.get("sharded_record")
    if record is None and live is None:
        return None  # whole state into a job that is not sharded: as before
    try:
        trees = live() if live is not None else None
        shards.fit(record, trees, restored.shared)
        if record is not None:
            restored.shared = shards.rebuild(restored.shared, record, trees)
    except shards.Mismatch as exc:
        return f"{MISFIT}{exc}"
    except Exception as exc:  # the job's state could not be looked at: the durable one
        return f"{MISFIT}{type(exc).__name__}: {exc}"
    return None


def _load(snaps: MemorySnapshots, step: int) -> tuple[Restored | None, str | None]:
    """Read this rank's snapshot of ``step`` once: digest checked, then loaded."""
    assert snaps.folder is not None
    return load_file(snaps.folder / store.snapshot_name(step), step, snaps.world_size)


def load_file(path: Path, step: int, world_size: int) -> tuple[Restored | None, str | None]:
    """Read the snapshot file at ``path`` once: digest checked, then loaded; or why not."""
    started = time.perf_counter()
    try:
        header = store.read_header(path)
        data = store.payload(path)
        digest = store.hasher(header)
        digest.update(data)
        if digest.hexdigest() != header["digest"]:
            raise store.Rejected("digest mismatch: the payload is not what was sealed")
        state = _decode(header, data)
    except Exception as exc:  # a torn or altered file: the ranks try an older step
        return None, f"{path.name}: {exc}"
    manifest: dict[str, Any] = {"step": step, "world_size": world_size,
                                "source": SOURCE, "shared": list(state["shared"]),
                                "digest": header["digest"], "bytes": header["bytes"],
                                "load_seconds": round(time.perf_counter() - started, 6),
                                "sharded": "sharded" in state,
                                "sharded_record": state.get("sharded")}
    return Restored(Path(path), step, manifest, state["shared"], state["rank"]), None


def _decode(header: dict[str, Any], data: bytearray) -> Any:
    """The state in a payload whose digest was checked: payload.py's raw format (version
    3), or ``torch.save``'d (versions 1 and 2, written before it)."""
    version = header.get("version")
    if version == store.VERSION:
        state = payload.decode(data)
    elif version in (1, 2):
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    else:
        raise store.Rejected(f"snapshot format version {version!r}: not one this trainwatch "
                             f"reads (1 to {store.VERSION})")
    if not (isinstance(state, dict) and isinstance(state.get("shared"), dict)
            and isinstance(state.get("rank"), dict)):
        raise store.Rejected("the payload holds no state trees")
    return state
