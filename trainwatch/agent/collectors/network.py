"""Network: NIC counters, InfiniBand/RoCE ports, and TCP reachability of the job's peers.

Reads ``<sys_root>/class/net`` and ``<sys_root>/class/infiniband`` (fixture trees in
tests).  IB data counters count 4-byte words (exported as bytes); counter files that
read "N/A" or are missing are skipped.  Link flaps are ``carrier_changes`` (NICs) and
``link_downed`` (IB).  Peers are each job's MASTER_ADDR:MASTER_PORT (from its ranks'
environment) plus configured ``peers``; a connect is timed, never retried inline.
"""

from __future__ import annotations

from typing import Any

from trainwatch.agent.registry import Collector, Result, register
from trainwatch.host.network import connect_seconds, infiniband_ports, interfaces

NIC_METRICS = {
    "rx_bytes": "trainwatch_network_receive_bytes_total",
    "tx_bytes": "trainwatch_network_transmit_bytes_total",
    "rx_errors": "trainwatch_network_receive_errors_total",
    "tx_errors": "trainwatch_network_transmit_errors_total",
    "rx_dropped": "trainwatch_network_receive_drops_total",
    "tx_dropped": "trainwatch_network_transmit_drops_total",
}


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
        nics = interfaces(self.ctx.sys_path("class", "net"), self.options["exclude_interfaces"])
        for entry in nics:
            lab = {"node": self.ctx.node, "device": entry["device"]}
            result.add("trainwatch_network_up", entry["up"], **lab)
            errors = 0
            for name, metric in NIC_METRICS.items():
                value = entry[name]
                result.add(metric, value, **lab)
                if value is not None and ("errors" in name or "dropped" in name):
                    errors += value
            result.add("trainwatch_network_carrier_changes_total", entry["carrier_changes"],
                       **lab)
            self._grew(entry["device"], errors, growing)
        return nics

    def _infiniband(self, result: Result, growing: list[str]) -> list[dict[str, Any]]:
        out = []
        for p in infiniband_ports(self.ctx.sys_path("class", "infiniband")):
            lab = {"node": self.ctx.node, "device": p["device"], "port": p["port"]}
            result.add("trainwatch_network_ib_port_active", p["state"] == "ACTIVE", **lab)
            result.add("trainwatch_network_ib_port_info", 1, **lab, state=p["state"],
                       phys_state=p["phys_state"], link_layer=p["link_layer"])
            result.add("trainwatch_network_ib_rate_bytes_per_second",
                       p["rate_bytes_per_second"], **lab)
            result.add("trainwatch_network_ib_receive_bytes_total", p["receive_bytes"], **lab)
            result.add("trainwatch_network_ib_transmit_bytes_total", p["transmit_bytes"], **lab)
            for name, value in p["errors"].items():
                result.add("trainwatch_network_ib_errors_total", value, **lab, counter=name)
            self._grew(f"{p['device']}/{p['port']}", sum(p["errors"].values()), growing)
            out.append({k: v for k, v in p.items()
                        if k not in ("receive_bytes", "transmit_bytes")})
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
