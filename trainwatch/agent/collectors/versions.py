"""Versions: driver, CUDA, torch, NCCL, Python and trainwatch on this node, as one _info
series, so version skew across nodes can alert.  Unknown versions are ''.

torch and NCCL versions come from package metadata (the agent never imports torch:
it would cost it hundreds of MiB); the NCCL version a running job actually loaded is
preferred when its RAS endpoint reported one; driver and CUDA come from NVML.
"""

from __future__ import annotations

import platform
from importlib import metadata

from trainwatch import __version__
from trainwatch.agent.registry import Collector, Result, register

_NCCL_PACKAGES = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")


def _package_version(*names: str) -> str:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return ""


@register("versions", interval=60.0, timeout=10.0, first_delay=6.0)
class VersionsCollector(Collector):
    def collect(self) -> Result:
        gpu = self.ctx.store.data("gpu") or {}
        nccl = self.ctx.store.data("nccl") or {}
        versions = {
            "driver": gpu.get("driver") or "",
            "cuda": gpu.get("cuda") or "",
            "torch": _package_version("torch"),
            "nccl": nccl.get("nccl_version") or _package_version(*_NCCL_PACKAGES),
            "python": platform.python_version(),
            "trainwatch": __version__,
        }
        result = Result(data=versions)
        result.add("trainwatch_versions_info", 1, node=self.ctx.node, **versions)
        return result
