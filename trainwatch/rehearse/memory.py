"""How much memory a piece of training took: peak above a baseline taken just before it.

On a GPU that is ``torch.cuda.max_memory_allocated``. On a CPU it is the process's peak
resident set (``VmHWM``) above the resident set at the baseline. Linux lets a process reset
that high-water mark (``/proc/self/clear_refs``, value 5), so earlier peaks (imports, data
loading) do not hide this one; where the reset is refused the peak is compared with the
earlier one instead and is unknown when it is not higher. Freed memory must go back to the
system for the baseline to mean anything: the rehearsal starts its ranks with
``MALLOC_MMAP_THRESHOLD_`` so glibc serves large tensors with mmap and unmaps them on free.
"""

from __future__ import annotations

import resource
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    import torch

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
PROC_SELF = "/proc/self"


def _reset_high_water() -> bool:
    """Reset this process's peak resident set to its current one; False where refused."""
    try:
        with open(f"{PROC_SELF}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _high_water() -> int | None:
    """``VmHWM`` of this process in bytes; None where /proc does not say."""
    try:
        with open(f"{PROC_SELF}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class PeakMemory:
    """``PeakMemory(device)`` marks the baseline; ``.peak_bytes()`` is the peak above it."""

    def __init__(self, device: torch.device):
        import torch  # the parent process that only needs MALLOC_ENV never loads torch

        self.device = device
        self._reset = False
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device)
            self.kind = "cuda_max_allocated"
            return
        self.kind = "cpu_peak_rss"
        self._reset = _reset_high_water() and _high_water() is not None
        self.base = psutil.Process().memory_info().rss
        self._earlier_peak = 0 if self._reset else _max_rss()

    def peak_bytes(self) -> int | None:
        """None when an earlier peak hides this one (CPU, where the reset was refused)."""
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.base
        peak = _high_water() if self._reset else _max_rss()
        if peak is None or peak <= self._earlier_peak:
            return None
        return max(0, peak - self.base)
