"""The GPU behind an interface: ``GpuBackend`` reads NVML into plain snapshots.

``NvmlBackend`` is the real one (nvidia-ml-py, ``import pynvml``); tests pass a fake
with the same four methods.  Every field a GPU does not support is ``None`` and is
not exported.  No library or driver -> ``GpuUnavailable`` with the reason, so the
collector reports "absent" and never invents numbers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

# NVML clock-event (throttle) reason bits -> names used in the metrics contract.
CLOCK_EVENT_BITS = {
    0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
    0x100: "display_clocks",
}
NVLINK_ERROR_TYPES = ("replay", "recovery", "crc_flit", "crc_data")


class GpuUnavailable(Exception):
    """NVML cannot be used here; the message says why (shown as the absent reason)."""


@dataclass
class GpuSnapshot:
    index: int
    uuid: str
    name: str = ""
    utilization: float | None = None          # 0-1
    memory_used: int | None = None
    memory_total: int | None = None
    temperature: float | None = None          # celsius
    power_watts: float | None = None
    power_limit_watts: float | None = None
    sm_clock_hz: float | None = None
    sm_clock_max_hz: float | None = None
    clock_events: dict[str, bool] | None = None
    ecc: dict[str, int] | None = None         # corrected / uncorrected
    retired_pages: dict[str, int] | None = None  # single_bit / double_bit
    retired_pending: bool | None = None
    remapped_rows: dict[str, int] | None = None  # correctable / uncorrectable
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    nvlink_errors: dict[int, dict[str, int]] = field(default_factory=dict)
    pcie_replay: int | None = None
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, bytes)


class GpuBackend(Protocol):
    def open(self) -> tuple[str, str]:
        """Initialise; return (driver version, CUDA driver version); raise GpuUnavailable."""

    def snapshots(self) -> list[GpuSnapshot]: ...

    def xid_events(self) -> list[tuple[int, int]]:
        """Drain pending XID events as (gpu index, xid) without blocking."""

    def close(self) -> None: ...


class NvmlBackend:
    """Real NVML through nvidia-ml-py.  Not exercised on machines without a GPU."""

    def __init__(self) -> None:
        self._nv: Any = None
        self._handles: list[Any] = []
        self._events: Any = None

    def open(self) -> tuple[str, str]:
        try:
            import pynvml as nv
        except ImportError as exc:
            raise GpuUnavailable(f"nvidia-ml-py is not installed ({exc})") from None
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            raise GpuUnavailable(f"NVML init failed: {exc}") from None
        self._nv = nv
        count = nv.nvmlDeviceGetCount()
        self._handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self._events = self._try(nv.nvmlEventSetCreate)
        if self._events is not None:
            for handle in self._handles:
                self._try(functools.partial(nv.nvmlDeviceRegisterEvents, handle,
                                            nv.nvmlEventTypeXidCriticalError, self._events))
        driver = _text(self._try(nv.nvmlSystemGetDriverVersion) or "")
        cuda = self._try(nv.nvmlSystemGetCudaDriverVersion)
        cuda_text = f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else ""
        return driver, cuda_text

    def close(self) -> None:
        if self._nv is not None:
            if self._events is not None:
                self._try(lambda: self._nv.nvmlEventSetFree(self._events))
            self._try(self._nv.nvmlShutdown)
            self._nv = None

    def _try(self, fn: Callable[[], Any]) -> Any:
        """Call an NVML getter; unsupported or failing fields are None, never invented."""
        error = self._nv.NVMLError if self._nv else Exception
        try:
            return fn()
        except error:
            return None

    def snapshots(self) -> list[GpuSnapshot]:
        nv, out = self._nv, []
        for index, h in enumerate(self._handles):
            t = lambda fn, *a, h=h: self._try(lambda: fn(h, *a))  # noqa: E731
            util = t(nv.nvmlDeviceGetUtilizationRates)
            mem = t(nv.nvmlDeviceGetMemoryInfo)
            power, limit = t(nv.nvmlDeviceGetPowerUsage), t(nv.nvmlDeviceGetEnforcedPowerLimit)
            sm, sm_max = (t(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_SM),
                          t(nv.nvmlDeviceGetMaxClockInfo, nv.NVML_CLOCK_SM))
            reasons = t(getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons",
                                nv.nvmlDeviceGetCurrentClocksThrottleReasons))
            snap = GpuSnapshot(
                index=index, uuid=_text(t(nv.nvmlDeviceGetUUID) or f"gpu{index}"),
                name=_text(t(nv.nvmlDeviceGetName) or ""),
                utilization=util.gpu / 100.0 if util is not None else None,
                memory_used=mem.used if mem is not None else None,
                memory_total=mem.total if mem is not None else None,
                temperature=t(nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU),
                power_watts=power / 1000.0 if power is not None else None,
                power_limit_watts=limit / 1000.0 if limit is not None else None,
                sm_clock_hz=sm * 1e6 if sm is not None else None,
                sm_clock_max_hz=sm_max * 1e6 if sm_max is not None else None,
                clock_events=({name: bool(reasons & bit) for bit, name in
                               CLOCK_EVENT_BITS.items()} if reasons is not None else None),
                pcie_replay=t(nv.nvmlDeviceGetPcieReplayCounter))
            ecc = [t(nv.nvmlDeviceGetTotalEccErrors, kind, nv.NVML_VOLATILE_ECC) for kind in
                   (nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)]
            if None not in ecc:
                snap.ecc = {"corrected": ecc[0], "uncorrected": ecc[1]}
            pages = [t(nv.nvmlDeviceGetRetiredPages, cause) for cause in (
                nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
                nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)]
            if None not in pages:
                snap.retired_pages = {"single_bit": len(pages[0]), "double_bit": len(pages[1])}
                pending = t(nv.nvmlDeviceGetRetiredPagesPendingStatus)
                snap.retired_pending = bool(pending) if pending is not None else None
            rows = t(nv.nvmlDeviceGetRemappedRows)
            if rows is not None:
                corr, unc, pending, failed = rows
                snap.remapped_rows = {"correctable": corr, "uncorrectable": unc}
                snap.remap_pending, snap.remap_failed = bool(pending), bool(failed)
            for link in range(nv.NVML_NVLINK_MAX_LINKS):
                if not t(nv.nvmlDeviceGetNvLinkState, link):
                    continue
                counters = {}
                for name, kind in zip(NVLINK_ERROR_TYPES, (
                        nv.NVML_NVLINK_ERROR_DL_REPLAY, nv.NVML_NVLINK_ERROR_DL_RECOVERY,
                        nv.NVML_NVLINK_ERROR_DL_CRC_FLIT, nv.NVML_NVLINK_ERROR_DL_CRC_DATA)):
                    value = t(nv.nvmlDeviceGetNvLinkErrorCounter, link, kind)
                    if value is not None:
                        counters[name] = value
                if counters:
                    snap.nvlink_errors[link] = counters
            procs = t(nv.nvmlDeviceGetComputeRunningProcesses) or []
            snap.processes = [(p.pid, p.usedGpuMemory) for p in procs]
            out.append(snap)
        return out

    def xid_events(self) -> list[tuple[int, int]]:
        if self._events is None:
            return []
        nv, events = self._nv, []
        index_of = {id(h): i for i, h in enumerate(self._handles)}
        for _ in range(1000):  # bounded drain
            try:
                data = nv.nvmlEventSetWait(self._events, 0)
            except nv.NVMLError:  # NVMLError_Timeout: nothing pending
                break
            uuid = _text(self._try(functools.partial(nv.nvmlDeviceGetUUID, data.device)) or "")
            index = next((i for i, h in enumerate(self._handles)
                          if _text(self._try(functools.partial(nv.nvmlDeviceGetUUID, h)) or "")
                          == uuid),
                         index_of.get(id(data.device), -1))
            events.append((index, int(data.eventData)))
        return events


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
