"""A fake GPU backend with the interface of trainwatch.host.nvml.NvmlBackend (no GPU here)."""

from __future__ import annotations

from trainwatch.host.nvml import GpuSnapshot, GpuUnavailable


class FakeGpuBackend:
    def __init__(self, snapshots: list[GpuSnapshot] | None = None, *,
                 unavailable: str | None = None):
        self._snapshots = snapshots or []
        self.unavailable = unavailable
        self.pending_xids: list[tuple[int, int]] = []
        self.opened = self.closed = 0

    def open(self) -> tuple[str, str]:
        self.opened += 1
        if self.unavailable:
            raise GpuUnavailable(self.unavailable)
        return "550.54.15", "12.4"

    def snapshots(self) -> list[GpuSnapshot]:
        return self._snapshots

    def xid_events(self) -> list[tuple[int, int]]:
        events, self.pending_xids = self.pending_xids, []
        return events

    def close(self) -> None:
        self.closed += 1
