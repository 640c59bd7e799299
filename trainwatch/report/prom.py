"""The report's headline numbers as a node_exporter textfile (``--prom-textfile``).

Names, help and labels come from trainwatch/contract/metrics.py (subsystem ``cost``).
prometheus-client writes the file to a temporary name and renames it, so the textfile
collector never reads half a file. A number the report does not know is left out.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from trainwatch.contract.metrics import METRICS
from trainwatch.errors import ConfigError, output_error
from trainwatch.rundir.atomic import atomic_write_bytes


class _ReportCollector:
    def __init__(self, data: dict[str, Any]):
        self.data = data

    def _gauge(self, name: str, value: Any) -> Metric | None:
        spec = METRICS[name]
        family = GaugeMetricFamily(name, spec.help, labels=list(spec.labels))
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            family.add_metric([self.data["job"]], float(value))
            return family
        return None

    def collect(self) -> Iterator[Metric]:
        d = self.data
        singles = {
            "trainwatch_cost_goodput_ratio": d["goodput_ratio"],
            "trainwatch_cost_effective_training_time_ratio": d["effective_training_time_ratio"],
            "trainwatch_cost_wall_seconds": d["time"]["wall_seconds"],
            "trainwatch_cost_productive_seconds": d["categories"]["productive"],
            "trainwatch_cost_accelerators": d["cost"]["accelerators"],
            "trainwatch_cost_incidents": len(d["incidents"]),
            "trainwatch_cost_recomputed_steps": d["steps"]["recomputed"],
            "trainwatch_cost_productive_tokens": d["tokens"]["productive"],
        }
        for name, value in singles.items():
            family = self._gauge(name, value)
            if family is not None:
                yield family
        spec = METRICS["trainwatch_cost_badput_seconds"]
        badput = GaugeMetricFamily(spec.name, spec.help, labels=list(spec.labels))
        for category, seconds in d["categories"].items():
            if category != "productive":
                badput.add_metric([d["job"], category], float(seconds))
        yield badput


def write_textfile(path: str | Path, data: dict[str, Any]) -> None:
    """Replace ``path`` atomically (a temporary file beside it, renamed), so the textfile
    collector never reads half a file; only a regular file is ever replaced: a device, FIFO,
    socket, directory or symlink at ``path`` is refused (exit 2), never overwritten."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise output_error(exc, path, key="--prom-textfile") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise ConfigError("exists and is not a regular file (a device, FIFO, symlink or "
                          "directory): not replacing it", file=str(path), key="--prom-textfile")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ReportCollector(data))
    try:
        atomic_write_bytes(path, generate_latest(registry))
    except OSError as exc:
        raise output_error(exc, path, key="--prom-textfile") from None
