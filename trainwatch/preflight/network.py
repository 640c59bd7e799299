"""Network checks: NICs and InfiniBand ports up, peers and the master reachable, clock.

NICs and IB ports are read by the host network probes the agent uses too
(``<sys_root>/class/net`` and ``/class/infiniband``); connects are timed the same way.  The clock
offset comes from ``chronyc tracking`` when chrony answers, NTP sync state from
``timedatectl`` otherwise; with neither the check is skipped.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import re
import shutil
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from trainwatch.errors import ConfigError
from trainwatch.host.network import connect_seconds, infiniband_ports, interfaces
from trainwatch.preflight.model import Check, Request

CLOCK_TIMEOUT = 3.0
_CHRONY_OFFSET = re.compile(r"^System time\s*:\s*([\d.]+) seconds (fast|slow)", re.M)
_CHRONY_LEAP = re.compile(r"^Leap status\s*:\s*(.+)$", re.M)


def parse_address(text: str, option: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); anything else is exit 2 naming the option."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"'{text}' is not HOST:PORT (port 1-65535)", key=option)
    return host, int(port)


def check_network(request: Request, cfg: dict[str, Any], sys_root: str) -> list[Check]:
    links = _links(sys_root)
    checks = [check_interfaces(links["interfaces"], cfg, sys_root),
              check_infiniband(links["infiniband"], cfg, sys_root)]
    targets = [("network.master", request.master)] if request.master else []
    targets += [(f"network.peer.{h}:{p}", (h, p)) for h, p in request.peers]
    if targets:
        with ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
            checks += pool.map(lambda t: check_peer(t[0], t[1][0], t[1][1], cfg), targets)
    else:
        checks.append(Check("network.peers", "skipped", "no --peer or --master given"))
    checks.append(check_clock(cfg))
    return checks


def _links(sys_root: str) -> dict[str, Any]:
    """NICs and IB ports, read as the agent's network collector reads them."""
    return {"interfaces": interfaces(Path(sys_root, "class", "net")),
            "infiniband": infiniband_ports(Path(sys_root, "class", "infiniband"))}


def _ignored(name: str, cfg: dict[str, Any], sys_root: str) -> bool:
    if any(fnmatch.fnmatch(name, pattern) for pattern in cfg["ignore_interfaces"]):
        return True
    real = os.path.realpath(os.path.join(sys_root, "class", "net", name))
    return bool(cfg["ignore_virtual"]) and "/devices/virtual/" in real


def check_interfaces(nics: list[dict[str, Any]], cfg: dict[str, Any], sys_root: str) -> Check:
    seen = [n for n in nics if not _ignored(n["device"], cfg, sys_root)]
    evidence = {"interfaces": {n["device"]: n["operstate"] for n in seen},
                "ignored": sorted(n["device"] for n in nics if n not in seen),
                "required": cfg["require_interfaces"]}
    up = [n["device"] for n in seen if n["up"]]
    down = [n["device"] for n in seen if not n["up"]]
    missing = [name for name in cfg["require_interfaces"] if name not in up]
    if missing:
        return Check("network.interfaces", "fail", f"required interface(s) not up: "
                     f"{', '.join(missing)}", evidence, runbook="NetworkLinkFlapping")
    if not up:
        return Check("network.interfaces", "fail", "no network interface is up"
                     if seen else f"no network interface under {sys_root}/class/net",
                     evidence, runbook="NetworkLinkFlapping")
    if down:
        return Check("network.interfaces", "warn", f"up: {', '.join(up)}; down: "
                     f"{', '.join(down)} (not required; ignore it in network.ignore_interfaces)",
                     evidence, runbook="NetworkLinkFlapping")
    return Check("network.interfaces", "ok", f"up: {', '.join(up)}", evidence)


def check_infiniband(ports: list[dict[str, Any]], cfg: dict[str, Any], sys_root: str) -> Check:
    if not ports:
        return Check("network.infiniband", "absent",
                     f"no InfiniBand/RoCE ports under {sys_root}/class/infiniband")
    name = lambda p: f"{p['device']}/{p['port']}"  # noqa: E731
    evidence = {"ports": {name(p): {"state": p["state"], "phys_state": p["phys_state"],
                                    "link_layer": p["link_layer"],
                                    "rate_bytes_per_second": p["rate_bytes_per_second"]}
                          for p in ports}, "required": cfg["require_ib_ports"]}
    active = [name(p) for p in ports if p["state"] == "ACTIVE"]
    inactive = [f"{name(p)} {p['state'] or '?'}/{p['phys_state'] or '?'}" for p in ports
                if p["state"] != "ACTIVE"]
    missing = [n for n in cfg["require_ib_ports"] if n not in active]
    if missing:
        return Check("network.infiniband", "fail", f"required port(s) not ACTIVE: "
                     f"{', '.join(missing)}", evidence, runbook="NetworkLinkFlapping")
    if inactive:
        return Check("network.infiniband", "warn", f"ACTIVE: {', '.join(active) or 'none'}; "
                     f"not: {', '.join(inactive)}", evidence, runbook="NetworkLinkFlapping")
    return Check("network.infiniband", "ok", f"{len(active)} port(s) ACTIVE", evidence)


def check_peer(id_: str, host: str, port: int, cfg: dict[str, Any]) -> Check:
    """A timed TCP connect.  For the master, 'connection refused' means the host answered
    and nothing listens yet (normal before rank 0 starts): warn, not fail."""
    address = f"{host}:{port}"
    evidence: dict[str, Any] = {"address": address, "timeout_seconds":
                                cfg["connect_timeout_seconds"]}
    try:
        seconds = connect_seconds(host, port, float(cfg["connect_timeout_seconds"]))
    except OSError as exc:
        reason = _connect_error(exc)
        evidence["error"] = reason
        if id_ == "network.master" and isinstance(exc, ConnectionRefusedError):
            return Check(id_, "warn", f"master {address}: host answered, nothing listens on "
                         f"port {port} yet", evidence, runbook="NCCLPeerUnresponsive")
        return Check(id_, "fail", f"{address} unreachable: {reason}", evidence,
                     runbook="NCCLPeerUnresponsive")
    evidence["connect_seconds"] = round(seconds, 6)
    text = f"{address} connects in {seconds * 1000:.1f} ms"
    if seconds > float(cfg["warn_connect_seconds"]):
        return Check(id_, "warn", f"{text} (slow: over {cfg['warn_connect_seconds']:g} s)",
                     evidence, runbook="NCCLPeerUnresponsive")
    return Check(id_, "ok", text, evidence)


def _connect_error(exc: OSError) -> str:
    if isinstance(exc, socket.gaierror):
        return f"name not resolved ({exc.strerror})"
    if isinstance(exc, TimeoutError) or exc.errno == errno.ETIMEDOUT:
        return "no answer (timed out: firewall, wrong address, host down?)"
    return exc.strerror or str(exc) or type(exc).__name__


def parse_chrony(text: str) -> tuple[float | None, str | None]:
    """(offset in seconds, + when fast; leap status) from `chronyc tracking` output."""
    offset = _CHRONY_OFFSET.search(text)
    leap = _CHRONY_LEAP.search(text)
    value = None
    if offset:
        value = float(offset.group(1)) * (1 if offset.group(2) == "fast" else -1)
    return value, leap.group(1).strip() if leap else None


def _run(cmd: list[str]) -> str | None:
    """stdout of a command that succeeded in time, else None."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=CLOCK_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def check_clock(cfg: dict[str, Any]) -> Check:
    tried = []
    if shutil.which("chronyc"):
        out = _run(["chronyc", "-n", "tracking"])
        if out is not None:
            return clock_from_chrony(out, cfg)
        tried.append("chronyc tracking failed (chronyd not running?)")
    if shutil.which("timedatectl"):
        out = _run(["timedatectl", "show", "-p", "NTPSynchronized", "--value"])
        if out is not None and out.strip() in ("yes", "no"):
            synced = out.strip() == "yes"
            return Check("network.clock", "ok" if synced else "warn",
                         "clock synchronised by NTP (timedatectl; no offset figure)" if synced
                         else "clock NOT synchronised by NTP (timedatectl)",
                         {"source": "timedatectl", "ntp_synchronized": synced})
        tried.append("timedatectl failed (no systemd?)")
    return Check("network.clock", "skipped", "clock state not readable: " + (
        "; ".join(tried) or "neither chronyc nor timedatectl installed"), {"tried": tried})


def clock_from_chrony(text: str, cfg: dict[str, Any]) -> Check:
    offset, leap = parse_chrony(text)
    evidence = {"source": "chronyc tracking", "offset_seconds": offset, "leap_status": leap}
    if offset is None:
        return Check("network.clock", "skipped", "chronyc tracking gave no offset", evidence)
    text = f"clock {abs(offset) * 1000:.3f} ms {'fast' if offset > 0 else 'slow'} (chrony)"
    if abs(offset) >= cfg["fail_clock_offset_seconds"]:
        return Check("network.clock", "fail", text, evidence)
    if abs(offset) >= cfg["warn_clock_offset_seconds"] or (leap and leap != "Normal"):
        return Check("network.clock", "warn", text + (
            f", leap status {leap}" if leap and leap != "Normal" else ""), evidence)
    return Check("network.clock", "ok", text, evidence)
