"""GPU checks through the agent's NVML interface (``agent/nvml.py``).

No NVML or no driver: every GPU check is ``absent`` with NVML's reason (and the count
check fails if GPUs were expected) - never invented numbers.  A field the GPU does not
report is left out of the verdict and said so in the evidence.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import psutil

from trainwatch.host.nvml import GpuSnapshot, GpuUnavailable, NvmlBackend
from trainwatch.preflight.model import Check

GIB = 1 << 30


class GpuProbe:
    """Opens NVML once per preflight; the GPU checks and the version check share it."""

    def __init__(self, factory: Callable[[], Any] = NvmlBackend):
        self._factory = factory
        self._opened = False
        self.backend: Any = None
        self.reason: str | None = None
        self.driver = self.cuda = ""
        self.snapshots: list[GpuSnapshot] = []

    def open(self) -> bool:
        """True if NVML answered; otherwise ``reason`` says why not."""
        if not self._opened:
            self._opened = True
            backend = self._factory()
            try:
                self.driver, self.cuda = backend.open()
                self.snapshots = backend.snapshots()
            except GpuUnavailable as exc:
                self.reason = str(exc)
                return False
            except Exception as exc:  # NVML answered, then broke: the GPU group fails
                self.reason = f"NVML failed: {type(exc).__name__}: {exc}"
                backend.close()
                raise
            self.backend = backend
        return self.backend is not None

    def watch_xids(self, seconds: float) -> list[tuple[int, int]]:
        """XID events (gpu index, xid) that NVML delivers within ``seconds``."""
        events: list[tuple[int, int]] = []
        deadline = time.monotonic() + seconds
        while True:
            events += self.backend.xid_events()
            left = deadline - time.monotonic()
            if left <= 0:
                return events
            time.sleep(min(0.25, left))

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
            self.backend = None


def check_gpus(probe: GpuProbe, cfg: dict[str, Any]) -> list[Check]:
    expect = cfg["expect_count"]
    if not probe.open():
        message = f"no GPUs: {probe.reason}"
        count = Check("gpu.count", "fail" if expect else "absent",
                      f"expected {expect} GPU(s); {message}" if expect else message,
                      {"expected": expect, "reason": probe.reason})
        return [count] + [Check(id_, "absent", message, {"reason": probe.reason})
                          for id_ in ("gpu.ecc", "gpu.xid", "gpu.thermal", "gpu.memory")]
    snaps = probe.snapshots
    if not snaps:
        return [Check("gpu.count", "fail" if expect else "absent",
                      f"NVML reports no GPUs (expected {expect})" if expect else
                      "NVML reports no GPUs", {"expected": expect, "driver": probe.driver})]
    return [_count(snaps, expect, probe), _ecc(snaps), _xid(probe, cfg), _thermal(snaps, cfg),
            _memory(snaps, cfg)]


def _count(snaps: list[GpuSnapshot], expect: int | None, probe: GpuProbe) -> Check:
    evidence = {"count": len(snaps), "expected": expect, "driver": probe.driver,
                "cuda": probe.cuda, "gpus": [f"{g.index}: {g.name} {g.uuid}" for g in snaps]}
    if expect is not None and len(snaps) != expect:
        return Check("gpu.count", "fail", f"{len(snaps)} GPU(s) visible, expected {expect} "
                     "(a GPU fell off the bus? CUDA_VISIBLE_DEVICES?)", evidence,
                     runbook="GPUXidErrors")
    return Check("gpu.count", "ok", f"{len(snaps)} GPU(s), driver {probe.driver}", evidence)


def _ecc(snaps: list[GpuSnapshot]) -> Check:
    problems, reported = [], 0
    for g in snaps:
        if g.ecc is None and g.retired_pending is None and g.remapped_rows is None:
            continue
        reported += 1
        uncorrected = (g.ecc or {}).get("uncorrected")
        if uncorrected:
            problems.append(f"GPU {g.index}: {uncorrected} uncorrectable ECC "
                            "error(s) since the driver loaded")
        if g.retired_pending:
            problems.append(f"GPU {g.index}: page retirement pending (reset the GPU)")
        if g.remap_pending:
            problems.append(f"GPU {g.index}: row remapping pending (reset the GPU)")
        if g.remap_failed:
            problems.append(f"GPU {g.index}: row remapping failed (replace the GPU)")
    evidence = {"problems": problems, "gpus": {
        str(g.index): {"ecc": g.ecc, "retired_pages": g.retired_pages,
                       "retired_pending": g.retired_pending, "remapped_rows": g.remapped_rows,
                       "remap_pending": g.remap_pending, "remap_failed": g.remap_failed}
        for g in snaps}}
    if problems:
        return Check("gpu.ecc", "fail", problems[0] + (f" (+{len(problems) - 1} more)"
                                                      if len(problems) > 1 else ""),
                     evidence, runbook="GPUUncorrectableECC")
    if not reported:
        return Check("gpu.ecc", "absent", "no GPU reports ECC, page retirement or row "
                     "remapping (ECC off or unsupported)", evidence)
    unreported = len(snaps) - reported
    return Check("gpu.ecc", "ok", "no uncorrectable ECC errors, nothing pending a reset" + (
        f" ({unreported} GPU(s) report no ECC)" if unreported else ""), evidence)


def _xid(probe: GpuProbe, cfg: dict[str, Any]) -> Check:
    seconds = float(cfg["xid_watch_seconds"])
    if seconds <= 0:
        return Check("gpu.xid", "skipped", "no XID watch window (pass --xid-watch SECONDS)")
    events = probe.watch_xids(seconds)
    ignored = set(cfg["xid_ignore"])
    bad = [(i, x) for i, x in events if x not in ignored]
    evidence = {"window_seconds": seconds, "events": [{"gpu": i, "xid": x} for i, x in events],
                "ignored": sorted(ignored)}
    if bad:
        text = ", ".join(f"GPU {i} XID {x}" for i, x in bad[:5])
        return Check("gpu.xid", "fail", f"{len(bad)} XID event(s) in {seconds:g} s: {text}",
                     evidence, runbook="GPUXidErrors")
    return Check("gpu.xid", "ok", f"no XID events in {seconds:g} s" + (
        f" ({len(events)} ignored)" if events else ""), evidence)


def _thermal(snaps: list[GpuSnapshot], cfg: dict[str, Any]) -> Check:
    fail, warn, unknown = [], [], []
    for g in snaps:
        if g.temperature is None:
            unknown.append(f"GPU {g.index}: temperature")
        elif g.temperature >= cfg["max_temperature_celsius"]:
            fail.append(f"GPU {g.index} at {g.temperature:g} °C")
        elif g.temperature >= cfg["warn_temperature_celsius"]:
            warn.append(f"GPU {g.index} at {g.temperature:g} °C")
        if g.clock_events is None:
            unknown.append(f"GPU {g.index}: clock-event reasons")
            continue
        active = [name for name, on in g.clock_events.items() if on]
        fail += [f"GPU {g.index} clocks held back by {n}" for n in active
                 if n in cfg["fail_clock_events"]]
        warn += [f"GPU {g.index} clocks held back by {n}" for n in active
                 if n in cfg["warn_clock_events"]]
    evidence = {"problems": fail + warn, "not_reported": unknown,
                "gpus": {str(g.index): {"temperature_celsius": g.temperature,
                                        "sm_clock_hz": g.sm_clock_hz,
                                        "sm_clock_max_hz": g.sm_clock_max_hz,
                                        "power_watts": g.power_watts,
                                        "power_limit_watts": g.power_limit_watts,
                                        "clock_events_active": sorted(
                                            n for n, on in (g.clock_events or {}).items() if on)}
                         for g in snaps}}
    runbook = "GPUThermalThrottling"
    if any("power" in p for p in fail + warn) and not any("thermal" in p or "°C" in p
                                                          for p in fail + warn):
        runbook = "GPUPowerThrottling"
    if fail:
        return Check("gpu.thermal", "fail", "; ".join(fail[:3]), evidence, runbook=runbook)
    if warn:
        return Check("gpu.thermal", "warn", "; ".join(warn[:3]), evidence, runbook=runbook)
    if len(unknown) == 2 * len(snaps):
        return Check("gpu.thermal", "absent", "no GPU reports temperature or clock-event "
                     "reasons", evidence)
    return Check("gpu.thermal", "ok", "temperatures below "
                 f"{cfg['warn_temperature_celsius']:g} °C, no thermal or power brake", evidence)


def _process(pid: int) -> str:
    """'pid 4242 python train.py (alice)' - as much as this user may see."""
    try:
        proc = psutil.Process(pid)
        cmd = " ".join(proc.cmdline()[:4]) or proc.name()
        return f"pid {pid} {cmd} ({proc.username()})"
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return f"pid {pid} (gone, or in another PID namespace)"
    except psutil.AccessDenied:
        return f"pid {pid} (not visible to this user)"


def _memory(snaps: list[GpuSnapshot], cfg: dict[str, Any]) -> Check:
    limit = float(cfg["max_memory_used_ratio"])
    fail, warn, gpus = [], [], {}
    for g in snaps:
        holders = [f"{_process(pid)} holds {used / GIB:.1f} GiB" if used is not None
                   else _process(pid) for pid, used in g.processes]
        gpus[str(g.index)] = {"memory_used_bytes": g.memory_used,
                              "memory_total_bytes": g.memory_total, "processes": holders}
        if g.memory_used is not None and g.memory_total:
            if g.memory_used / g.memory_total > limit:
                who = "; ".join(holders) or "no process listed (another container?)"
                fail.append(f"GPU {g.index}: {g.memory_used / GIB:.1f} of "
                            f"{g.memory_total / GIB:.1f} GiB in use by {who}")
                continue
        if holders:
            warn.append(f"GPU {g.index}: process(es) running: {'; '.join(holders)}")
    evidence = {"max_used_ratio": limit, "problems": fail + warn, "gpus": gpus}
    if fail:
        return Check("gpu.memory", "fail", fail[0] + (f" (+{len(fail) - 1} more GPU(s))"
                                                      if len(fail) > 1 else ""), evidence)
    if warn:
        return Check("gpu.memory", "warn", warn[0], evidence)
    return Check("gpu.memory", "ok", f"every GPU has at most {limit:.0%} of its memory in use "
                 "and no process on it", evidence)
