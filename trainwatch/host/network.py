"""Network probes: NIC and InfiniBand/RoCE port state and counters, timed TCP connects.

Shared by the agent's network collector and preflight's network checks. Reads
``<sys_root>/class/net`` and ``<sys_root>/class/infiniband``; counter files that read
"N/A" or are missing are None (NIC) or left out (IB errors). IB data counters count
4-byte words; they are returned as bytes.
"""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path
from typing import Any

from trainwatch.host.sysfs import read_int, read_text

NIC_COUNTERS = ("rx_bytes", "tx_bytes", "rx_errors", "tx_errors", "rx_dropped", "tx_dropped")
IB_ERROR_COUNTERS = (
    "symbol_error", "port_rcv_errors", "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors", "link_downed", "link_error_recovery",
    "port_xmit_discards", "port_xmit_constraint_errors", "port_rcv_constraint_errors",
    "local_link_integrity_errors", "excessive_buffer_overrun_errors", "VL15_dropped",
)
_RATE = re.compile(r"([\d.]+)\s*Gb/sec")


def _state_name(text: str | None) -> str:
    """'4: ACTIVE' -> 'ACTIVE'."""
    if not text:
        return ""
    return text.split(":", 1)[-1].strip()


def connect_seconds(host: str, port: int, timeout: float) -> float:
    """Seconds a TCP connect takes; raises OSError when it fails or times out."""
    started = time.perf_counter()
    with socket.create_connection((host, port), timeout=timeout):
        return time.perf_counter() - started


def interfaces(base: Path, exclude: list[str] | tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Every NIC under ``base`` (``<sys_root>/class/net``) but ``exclude``: operstate,
    counters and carrier changes (link flaps)."""
    if not base.is_dir():
        return []
    out = []
    for dev in sorted(p for p in base.iterdir() if p.name not in exclude):
        operstate = read_text(dev / "operstate")
        entry: dict[str, Any] = {"device": dev.name, "operstate": operstate,
                                 "up": operstate == "up"}
        for name in NIC_COUNTERS:
            entry[name] = read_int(dev / "statistics" / name)
        entry["carrier_changes"] = read_int(dev / "carrier_changes")
        out.append(entry)
    return out


def infiniband_ports(base: Path) -> list[dict[str, Any]]:
    """Every port under ``base`` (``<sys_root>/class/infiniband``): state, rate, data
    counters (bytes) and the error counters that exist."""
    if not base.is_dir():
        return []
    out = []
    for dev in sorted(base.iterdir()):
        ports = dev / "ports"
        if not ports.is_dir():
            continue
        for port in sorted(ports.iterdir(), key=lambda p: p.name):
            rate = _RATE.search(read_text(port / "rate") or "")
            counters = port / "counters"
            rcv, xmit = read_int(counters / "port_rcv_data"), read_int(counters / "port_xmit_data")
            errors = {}
            for name in IB_ERROR_COUNTERS:
                value = read_int(counters / name)
                if value is not None:
                    errors[name] = value
            out.append({
                "device": dev.name, "port": port.name,
                "state": _state_name(read_text(port / "state")),
                "phys_state": _state_name(read_text(port / "phys_state")),
                "link_layer": read_text(port / "link_layer") or "",
                "rate_bytes_per_second": float(rate.group(1)) * 1e9 / 8 if rate else None,
                "receive_bytes": rcv * 4 if rcv is not None else None,
                "transmit_bytes": xmit * 4 if xmit is not None else None,
                "errors": errors})
    return out
