"""The timing exchange: every rank's local seconds summed into a fixed-size sketch.

Per window each rank contributes its mean local seconds as a count and a sum in its bin
(``SKETCH_BINS`` bins, ``trainwatch.contract.timing``: one float32 tensor of counts then
sums, 35 KiB) and as two int64 keys, and the job all-reduces both (SUM, then MAX): every
rank gets the job's histogram, each bin's mean and the exact extremes, whatever the world
size, in the same bytes. float32 counts are exact to 2^24 ranks; a bin's sum of many
values may stray a little, and its mean is kept inside the bin. Before, an all-gather
handed every rank a row per rank (24 bytes x world) and summarizing them grew with it.

gloo runs an all-reduce as a ring: its latency still grows with the world size (the
ring's hops), and so does the number of (tiny) messages a rank sends, up to two per
element; what no longer grows is the bytes a rank sends and receives (about twice the
sketch) and what it sums and summarizes. Ranks past 2^24 would wrap in the key (and in
the float32 counts).
"""

from __future__ import annotations

import math
import struct
from typing import Any, NamedTuple, Sequence

import torch

from trainwatch.contract.timing import SKETCH_BINS, sketch_bin, summarize_bins

RANK_BITS = 24  # the slowest rank rides in the low bits of the largest value's key
_RANK_MASK = (1 << RANK_BITS) - 1


class Sketch(NamedTuple):
    """One window as the all-reduce sums it: ``bins`` holds the counts per bin then the sums
    of their values; ``extremes`` the largest value's key with its rank and minus the
    smallest value's key, for a MAX."""

    bins: torch.Tensor
    extremes: torch.Tensor


def _key(seconds: float) -> int:
    """An int64 that orders as the seconds do (a non-negative double's bits)."""
    value = seconds if seconds > 0.0 else 0.0  # NaN too
    return int(struct.unpack("<q", struct.pack("<d", min(value, 1e300)))[0])


def _seconds(key: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", key))[0])


def local_sketch(rank: int, local_seconds: float) -> Sketch:
    """This rank's share of the window: one count and its value in its bin, and its keys."""
    bins = torch.zeros(2 * SKETCH_BINS, dtype=torch.float32)
    index, view = sketch_bin(local_seconds), bins.numpy()  # numpy stores cost less than torch's
    view[index] = 1.0
    view[SKETCH_BINS + index] = local_seconds if math.isfinite(local_seconds) else 0.0
    largest = (_key(local_seconds) & ~_RANK_MASK) | (rank & _RANK_MASK)
    return Sketch(bins, torch.tensor([largest, -_key(local_seconds)], dtype=torch.int64))


def sketch_of(local_seconds: Sequence[float]) -> Sketch:
    """What the all-reduce hands every rank when the ranks' local seconds are these
    (index = rank): simulations and benchmarks of large jobs."""
    index = torch.tensor([sketch_bin(v) for v in local_seconds], dtype=torch.int64)
    values = torch.tensor(local_seconds, dtype=torch.float32)
    bins = torch.cat([torch.bincount(index, minlength=SKETCH_BINS).float(),
                      torch.zeros(SKETCH_BINS).index_add_(0, index, values)])
    largest = max(((_key(v) & ~_RANK_MASK) | r) for r, v in enumerate(local_seconds))
    smallest = max(-_key(v) for v in local_seconds)
    return Sketch(bins, torch.tensor([largest, smallest], dtype=torch.int64))


def start(dist: Any, group: Any, sketch: Sketch) -> list[Any]:
    """Start summing ``sketch`` over the group in place (asynchronously); the works."""
    return [dist.all_reduce(sketch.bins, op=dist.ReduceOp.SUM, group=group, async_op=True),
            dist.all_reduce(sketch.extremes, op=dist.ReduceOp.MAX, group=group,
                            async_op=True)]


def job_summary(sketch: Sketch, half_width: int) -> dict[str, Any]:
    """The job's summary from a summed sketch: O(bins), not O(ranks)."""
    summed = sketch.bins.numpy()  # numpy's indexing is several times quicker here
    counts, sums = summed[:SKETCH_BINS], summed[SKETCH_BINS:]
    nonzero = counts.nonzero()[0]
    bins = list(zip(nonzero.tolist(), counts[nonzero].astype("int64").tolist(),
                    sums[nonzero].tolist()))
    largest, smallest = sketch.extremes.tolist()
    return summarize_bins(bins, _seconds(-smallest), _seconds(largest & ~_RANK_MASK),
                          largest & _RANK_MASK, half_width)
