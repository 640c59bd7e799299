"""Rank 1 waits for an flock another process holds."""

import fcntl
from pathlib import Path

from trainwatch.drill.corpus.case import Case, Context, Expect

_HELD: dict[str, object] = {}


def hold_lock(work: Path) -> dict[str, str]:
    """The runner holds the lock for the whole run, as a stuck other job would."""
    fh = open(work / "dataset.lock", "a")
    fcntl.flock(fh, fcntl.LOCK_EX)
    _HELD[str(work)] = fh
    return {}


def release(work: Path) -> None:
    fh = _HELD.pop(str(work), None)
    if fh is not None:
        fh.close()  # type: ignore[attr-defined]


def take_lock(ctx: Context) -> None:
    fh = open(ctx.workdir / "dataset.lock", "a")
    fcntl.flock(fh, fcntl.LOCK_EX)


CASE = Case(
    kind="file_lock",
    simulates="a rank waits for a file lock (flock) another process holds (a shared cache "
              "or dataset index locked by a stuck job)",
    expect=Expect(category=("rank_stuck",), ranks=(1,), cause=("lock",)),
    fault=take_lock, phase="data", prepare=hold_lock, cleanup=release)
