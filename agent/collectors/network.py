"""Network: NIC counters, InfiniBand/RoCE ports, and TCP reachability of the job's peers.

Reads ``<sys_root>/class/net`` and ``<sys_root>/class/infiniband`` (fixture trees in
tests).  IB data counters count 4-byte words (exported as bytes); counter files that
read "N/A" or are missing are skipped.  Link flaps are ``carrier_changes`` (NICs) and
``link_downed`` (IB).  Peers are each job's MASTER_ADDR:MASTER_PORT (from its ranks'
environment) plus configured ``peers``; a connect is timed, never retried inline.
"""

from __future__ import annotations

import re
import socket
import time
from typing import Any

from trainwatch.agent.registry import Collector, Result, register
from trainwatch.host.sysfs import read_int, read_text

NIC_COUNTERS = {
    "rx_bytes": "trainwatch_network_receive_bytes_total",
    "tx_bytes": "trainwatch_network_transmit_bytes_total",
    "rx_errors": "trainwatch_network_receive_errors_total",
    "tx_errors": "trainwatch_network_transmit_errors_total",
    "rx_dropped": "trainwatch_network_receive_drops_total",
    "tx_dropped": "trainwatch_network_transmit_drops_total",
}
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
    started = time.perf_counter()
    with socket.create_connection((host, port), timeout=timeout):
        return time.perf_counter() - started


@register("network", interval=5.0, timeout=10.0, first_delay=1.5, options={
    "exclude_interfaces": ["lo"],
    "peers": [],                 # extra "host:port" to check, e.g. storage or a parameter server
    "connect_timeout": 1.0,
})
class NetworkCollector(Collector):
    def __init__(self, ctx, options):
        super().__init__(ctx, options)
        self._errors_prev: dict[str, int] = {}

    def collect(self) -> Result:
        result = Result()
        growing: list[str] = []
        nics = self._nics(result, growing)
        ports = self._infiniband(result, growing)
        peers = self._peers(result)
        result.data = {"interfaces": nics, "infiniband": ports, "peers": peers,
                       "errors_growing": growing}
        return result

    def _grew(self, key: str, total: int, growing: list[str]) -> None:
        previous = self._errors_prev.get(key)
        self._errors_prev[key] = total
        if previous is not None and total > previous:
            growing.append(key)

    def _nics(self, result: Result, growing: list[str]) -> list[dict[str, Any]]:
        base = self.ctx.sys_path("class", "net")
        if not base.is_dir():
            return []
        out = []
        for dev in sorted(p for p in base.iterdir() if p.name not in self.options[
                "exclude_interfaces"]):
            lab = {"node": self.ctx.node, "device": dev.name}
            operstate = read_text(dev / "operstate")
            entry: dict[str, Any] = {"device": dev.name, "operstate": operstate,
                                     "up": operstate == "up"}
            result.add("trainwatch_network_up", operstate == "up", **lab)
            errors = 0
            for name, metric in NIC_COUNTERS.items():
                value = read_int(dev / "statistics" / name)
                result.add(metric, value, **lab)
                entry[name] = value
                if value is not None and ("errors" in name or "dropped" in name):
                    errors += value
            flaps = read_int(dev / "carrier_changes")
            result.add("trainwatch_network_carrier_changes_total", flaps, **lab)
            entry["carrier_changes"] = flaps
            self._grew(dev.name, errors, growing)
            out.append(entry)
        return out

    def _infiniband(self, result: Result, growing: list[str]) -> list[dict[str, Any]]:
        base = self.ctx.sys_path("class", "infiniband")
        if not base.is_dir():
            return []
        out = []
        for dev in sorted(base.iterdir()):
            ports = dev / "ports"
            if not ports.is_dir():
                continue
            for port in sorted(ports.iterdir(), key=lambda p: p.name):
                lab = {"node": self.ctx.node, "device": dev.name, "port": port.name}
                state = _state_name(read_text(port / "state"))
                phys = _state_name(read_text(port / "phys_state"))
                layer = read_text(port / "link_layer") or ""
                result.add("trainwatch_network_ib_port_active", state == "ACTIVE", **lab)
                result.add("trainwatch_network_ib_port_info", 1, **lab, state=state,
                           phys_state=phys, link_layer=layer)
                rate = _RATE.search(read_text(port / "rate") or "")
                rate_bytes = float(rate.group(1)) * 1e9 / 8 if rate else None
                result.add("trainwatch_network_ib_rate_bytes_per_second", rate_bytes, **lab)
                counters = port / "counters"
                rcv, xmit = read_int(counters / "port_rcv_data"), read_int(
                    counters / "port_xmit_data")
                result.add("trainwatch_network_ib_receive_bytes_total",
                           rcv * 4 if rcv is not None else None, **lab)
                result.add("trainwatch_network_ib_transmit_bytes_total",
                           xmit * 4 if xmit is not None else None, **lab)
                errors, values = 0, {}
                for name in IB_ERROR_COUNTERS:
                    value = read_int(counters / name)
                    if value is None:
                        continue
                    values[name] = value
                    errors += value
                    result.add("trainwatch_network_ib_errors_total", value, **lab, counter=name)
                self._grew(f"{dev.name}/{port.name}", errors, growing)
                out.append({"device": dev.name, "port": port.name, "state": state,
                            "phys_state": phys, "link_layer": layer,
                            "rate_bytes_per_second": rate_bytes, "errors": values})
        return out

    def _peers(self, result: Result) -> list[dict[str, Any]]:
        targets: list[tuple[str, str, str]] = []  # (job, role, host:port)
        for job in (self.ctx.store.data("ranks") or {}).get("jobs", []):
            for env in (job.get("env") or {}).values():
                addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
                if addr and port:
                    targets.append((job["job"], "master", f"{addr}:{port}"))
                    break
        targets += [("", "peer", str(p)) for p in self.options["peers"]]
        out = []
        for job, role, peer in dict.fromkeys(targets):
            host, _, port = peer.rpartition(":")
            lab = {"node": self.ctx.node, "run": job, "role": role, "peer": peer}
            entry: dict[str, Any] = {"job": job, "role": role, "peer": peer, "up": False,
                                     "connect_seconds": None, "error": None}
            try:
                seconds = connect_seconds(host.strip("[]"), int(port),
                                          float(self.options["connect_timeout"]))
                entry.update(up=True, connect_seconds=round(seconds, 6))
                result.add("trainwatch_network_peer_connect_seconds", seconds, **lab)
            except (OSError, ValueError) as exc:
                entry["error"] = str(exc) or type(exc).__name__
            result.add("trainwatch_network_peer_up", entry["up"], **lab)
            out.append(entry)
        return out
