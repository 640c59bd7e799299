"""Which checkpoints to delete: keep the last N, the best K by validation loss, and always
the newest one that verifies.

Only complete checkpoints are candidates; the caller passes the newest verified one, which
is kept whatever the policy says, so repeated failed saves can never prune the last good one.
"""

from __future__ import annotations

from pathlib import Path

from trainwatch.checkpoint_format.catalog import Entry


def to_prune(entries: list[Entry], *, keep_last: int, keep_best: int,
             newest_verified: Path | None) -> list[tuple[Entry, str]]:
    """Complete checkpoints the policy lets go, each with the reason it is not kept."""
    complete = sorted((e for e in entries if e.state == "complete"),
                      key=lambda e: e.step or 0, reverse=True)
    keep = {e.path for e in complete[:max(1, keep_last)]}
    if keep_best:
        scored = sorted((e for e in complete if e.val_loss is not None),
                        key=lambda e: (e.val_loss, -(e.step or 0)))
        keep |= {e.path for e in scored[:keep_best]}
    if newest_verified is None:
        return []  # nothing verified: delete nothing, an unverified copy may be all there is
    keep.add(Path(newest_verified))
    reason = f"not among the last {keep_last}" + (f" or best {keep_best} by val_loss"
                                                  if keep_best else "")
    return [(e, reason) for e in complete if e.path not in keep]
