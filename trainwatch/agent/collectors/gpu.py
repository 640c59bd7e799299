"""GPU: per-GPU health from NVML, and each training rank's GPU memory (mapped by pid).

XID errors come from an NVML event set and are exported twice: a windowed count that
returns to 0 once they stop (``_recent``: what alerts use; dcgm-exporter's XID gauge
never resets) and a counter since the agent started (``_total``).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from trainwatch.host.nvml import GpuBackend, GpuUnavailable, NvmlBackend
from trainwatch.agent.registry import Collector, Result, register


@register("gpu", interval=5.0, timeout=4.0, options={"xid_window_seconds": 300.0})
class GpuCollector(Collector):
    def __init__(self, ctx, options):
        super().__init__(ctx, options)
        self.backend: GpuBackend | None = None
        self.versions: tuple[str, str] | None = None
        self._xids: deque = deque(maxlen=10000)  # (time, gpu index, xid)
        self._xid_totals: dict[tuple[int, int], int] = {}

    def _open(self) -> GpuBackend:
        backend: GpuBackend = (self.ctx.gpu_backend or NvmlBackend)()
        self.versions = backend.open()
        self.backend = backend
        return backend

    def collect(self) -> Result:
        backend = self.backend
        if backend is None:
            try:
                backend = self._open()
            except GpuUnavailable as exc:
                return Result.absent(str(exc), data={"state": "absent", "reason": str(exc),
                                                     "gpus": []})
        snaps = backend.snapshots()
        if not snaps:
            return Result.absent("NVML reports no GPUs", data={"state": "absent", "gpus": [],
                                                              "reason": "NVML reports no GPUs"})
        now = time.time()
        for index, xid in backend.xid_events():
            self._xids.append((now, index, xid))
            self._xid_totals[(index, xid)] = self._xid_totals.get((index, xid), 0) + 1
        window = float(self.options["xid_window_seconds"])
        while self._xids and self._xids[0][0] < now - window:
            self._xids.popleft()
        recent: dict[tuple[int, int], int] = {}
        for _, index, xid in self._xids:
            recent[(index, xid)] = recent.get((index, xid), 0) + 1

        ranks = self._ranks_by_pid()
        result = Result()
        gpus = []
        for g in snaps:
            gpus.append(self._export(g, result, ranks, recent))
        assert self.versions is not None  # set with the backend by _open
        result.data = {"state": "ok", "driver": self.versions[0], "cuda": self.versions[1],
                       "gpus": gpus}
        return result

    def _ranks_by_pid(self) -> dict[int, dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        for job in (self.ctx.store.data("ranks") or {}).get("jobs", []):
            for r in job["ranks"]:
                if isinstance(r.get("pid"), int):
                    out[r["pid"]] = {"run": job["job"], "rank": r["rank"],
                                     "local_rank": r.get("local_rank", "")}
        return out

    def _export(self, g, result: Result, ranks, recent) -> dict[str, Any]:
        node = self.ctx.node
        lab = {"node": node, "gpu": g.index, "uuid": g.uuid}
        result.add("trainwatch_gpu_info", 1, **lab, name=g.name)
        result.add("trainwatch_gpu_utilization_ratio", g.utilization, **lab)
        result.add("trainwatch_gpu_memory_used_bytes", g.memory_used, **lab)
        result.add("trainwatch_gpu_memory_total_bytes", g.memory_total, **lab)
        result.add("trainwatch_gpu_temperature_celsius", g.temperature, **lab)
        result.add("trainwatch_gpu_power_watts", g.power_watts, **lab)
        result.add("trainwatch_gpu_power_limit_watts", g.power_limit_watts, **lab)
        result.add("trainwatch_gpu_sm_clock_hertz", g.sm_clock_hz, **lab)
        result.add("trainwatch_gpu_sm_clock_max_hertz", g.sm_clock_max_hz, **lab)
        for reason, active in (g.clock_events or {}).items():
            result.add("trainwatch_gpu_clock_event_active", active, **lab, reason=reason)
        for kind, count in (g.ecc or {}).items():
            result.add("trainwatch_gpu_ecc_errors_total", count, **lab, type=kind)
        for cause, count in (g.retired_pages or {}).items():
            result.add("trainwatch_gpu_retired_pages", count, **lab, cause=cause)
        result.add("trainwatch_gpu_retired_pages_pending", g.retired_pending, **lab)
        for kind, count in (g.remapped_rows or {}).items():
            result.add("trainwatch_gpu_remapped_rows", count, **lab, type=kind)
        result.add("trainwatch_gpu_remapped_rows_pending", g.remap_pending, **lab)
        result.add("trainwatch_gpu_remapped_rows_failed", g.remap_failed, **lab)
        for link, counters in sorted(g.nvlink_errors.items()):
            for kind, count in counters.items():
                result.add("trainwatch_gpu_nvlink_errors_total", count, **lab, link=link,
                           type=kind)
        result.add("trainwatch_gpu_pcie_replay_total", g.pcie_replay, **lab)
        for (index, xid), count in sorted(self._xid_totals.items()):
            if index == g.index:
                result.add("trainwatch_gpu_xid_events_total", count, **lab, xid=xid)
                result.add("trainwatch_gpu_xid_events_recent", recent.get((index, xid), 0),
                           **lab, xid=xid)
        processes = []
        for pid, used in g.processes:
            owner = ranks.get(pid)
            processes.append({"pid": pid, "memory_bytes": used, **(owner or {})})
            if owner is not None:
                result.add("trainwatch_gpu_process_memory_bytes", used, **owner, node=node,
                           gpu=g.index, uuid=g.uuid)
        return {"index": g.index, "uuid": g.uuid, "name": g.name,
                "utilization": g.utilization, "memory_used": g.memory_used,
                "memory_total": g.memory_total, "temperature": g.temperature,
                "power_watts": g.power_watts, "clock_events": g.clock_events,
                "ecc": g.ecc, "xid_recent": {str(x): n for (i, x), n in recent.items()
                                             if i == g.index},
                "pids": [pid for pid, _ in g.processes], "processes": processes}
