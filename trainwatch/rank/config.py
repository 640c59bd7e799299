"""The ``telemetry`` section of the trainer config: how a rank's ``Telemetry`` publishes.

It sits beside the library it configures, torch-free, so the library takes its defaults
from it (``replicas.DEFAULT_EVERY``, ``reduction.DEFAULT_EVERY``) without importing the
reference trainer, and the trainer's config reads it without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainwatch.contract.ports import LOOPBACK


@dataclass
class TelemetryConfig:
    """Rank telemetry (trainwatch/rank/telemetry.py); ``peak_flops`` enables MFU on unknown devices."""

    enabled: bool = True
    heartbeat_interval: float = 1.0
    exchange_every: int = 10
    # Steps between parameter digests compared across replicas (docs/sdc.md: the overhead
    # measured at 50); 0: off.
    replica_every: int = 50
    # Steps between gradient checksums carried through DDP's all-reduce (docs/sdc.md: the
    # overhead measured at 50); 0: off. Needs DDP (a run under torchrun).
    reduction_every: int = 50
    peak_flops: float | None = None
    metrics_port: int | None = None  # local rank r serves metrics_host:(port + r)/metrics
    # Loopback unless told: in a pod, "0.0.0.0" lets a PodMonitor scrape the pod IP.
    metrics_host: str = LOOPBACK
