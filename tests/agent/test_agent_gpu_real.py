"""The real NVML path (agent/nvml.py NvmlBackend); runs only where an NVIDIA driver is."""

import pytest

from trainwatch.host.nvml import GpuUnavailable, NvmlBackend

pytestmark = pytest.mark.gpu


@pytest.fixture
def nvml():
    backend = NvmlBackend()
    try:
        versions = backend.open()
    except GpuUnavailable as exc:
        pytest.skip(f"no NVML here: {exc}")
    yield backend, versions
    backend.close()


def test_real_nvml_snapshot_is_plausible(nvml):
    backend, (driver, cuda) = nvml
    assert driver and cuda
    snaps = backend.snapshots()
    assert snaps, "NVML initialised but reports no GPU"
    for g in snaps:
        assert g.uuid.startswith(("GPU-", "MIG-"))
        assert g.memory_total and 0 <= g.memory_used <= g.memory_total
        if g.utilization is not None:
            assert 0.0 <= g.utilization <= 1.0
        if g.sm_clock_hz is not None and g.sm_clock_max_hz:
            assert 0 < g.sm_clock_hz <= g.sm_clock_max_hz * 1.01
        assert g.clock_events is None or set(g.clock_events) >= {"gpu_idle", "hw_slowdown"}
    assert isinstance(backend.xid_events(), list)  # drains without blocking
