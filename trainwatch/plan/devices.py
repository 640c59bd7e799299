"""The accelerators a plan is checked against: memory per device and dense bf16 peak.

Memory is the vendor's nominal figure in decimal GB (1e9 bytes). Where the vendor's
"GB" is really GiB (H100, A100) this is a little under what the device has, and the
20 % headroom covers what the driver, the CUDA context and the allocator's
fragmentation take. Peak FLOP/s come from the trainer's MFU table (one home for them).
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from trainwatch.rank.flops import peak_flops_for

GB = 1e9
HEADROOM = 0.20  # keep 20 % of device memory free: fragmentation, NCCL buffers, spikes


@dataclass(frozen=True)
class DeviceType:
    key: str
    name: str
    memory_bytes: float
    peak_flops: float | None  # dense bf16 FLOP/s; None: unknown (give --peak-flops)


def _gpu(key: str, name: str, memory_gb: float) -> DeviceType:
    return DeviceType(key, name, memory_gb * GB, peak_flops_for(name))


DEVICE_TYPES: dict[str, DeviceType] = {d.key: d for d in (
    _gpu("h100", "H100 SXM 80GB", 80),
    _gpu("h200", "H200 141GB", 141),
    _gpu("a100-40", "A100 40GB", 40),
    _gpu("a100-80", "A100 80GB", 80),
    _gpu("b200", "B200 180GB", 180),       # as configured in DGX B200 (192 GB of HBM3e)
    _gpu("mi300x", "MI300X 192GB", 192),
    DeviceType("cpu", "CPU RAM (this machine)", float(psutil.virtual_memory().total), None),
)}


def device_type(key: str) -> DeviceType:
    return DEVICE_TYPES[key.lower()]


def verdict(need_bytes: float, memory_bytes: float) -> str:
    """``fits`` within the headroom, ``tight`` (fits, but inside the 20 %), or ``does not fit``."""
    if need_bytes <= (1.0 - HEADROOM) * memory_bytes:
        return "fits"
    return "tight" if need_bytes <= memory_bytes else "does not fit"
