"""How much memory a piece of training took: peak above a baseline taken just before it.

On a GPU that is ``torch.cuda.max_memory_allocated``. On a CPU it is the peak resident
set (``ru_maxrss``) above the resident set at the baseline, which is only meaningful
when nothing earlier peaked higher (warm up with something small) and when freed memory
goes back to the system: the rehearsal starts its ranks with ``MALLOC_MMAP_THRESHOLD_``
so glibc serves large tensors with mmap and unmaps them on free.
"""

from __future__ import annotations

import resource
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    import torch

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class PeakMemory:
    """``PeakMemory(device)`` marks the baseline; ``.peak_bytes()`` is the peak above it."""

    def __init__(self, device: torch.device):
        import torch  # the parent process that only needs MALLOC_ENV never loads torch

        self.device = device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device)
            self.kind = "cuda_max_allocated"
        else:
            self.base = psutil.Process().memory_info().rss
            self.kind = "cpu_peak_rss"
        self._earlier_peak = _max_rss() if device.type != "cuda" else 0

    def peak_bytes(self) -> int | None:
        """None when an earlier peak hides this one (CPU only)."""
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.base
        peak = _max_rss()
        if peak <= self._earlier_peak:
            return None
        return peak - self.base
