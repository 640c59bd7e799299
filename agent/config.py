"""Agent configuration: defaults, YAML loading and validation (file, key, problem -> exit 2).

Every key is optional. Collector sections take the common keys ``enabled``,
``interval`` and ``timeout`` plus the options the collector declares when it
registers (see ``agent/registry.py``), so a typo is an error, never ignored.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainwatch.configfile import load_yaml_mapping
from trainwatch.contract.ports import AGENT_LISTEN
from trainwatch.contract.stall import STALL_DEFAULTS
from trainwatch.errors import ConfigError
from trainwatch.node import node_name

STRAGGLER_DEFAULTS: dict[str, Any] = {
    "ratio": 1.15,                 # flag: level (median ratio of the last windows) >= ratio
    "clear_ratio": 1.07,           # ... and keep the flag until the level drops below this
    "noise_sigmas": 4.0,           # flag only a level this many standard errors above 1
    "score": 3.0,                  # flag needs a median robust z-score >= score too
    "min_ranks_for_score": 4,      # (worlds of this many ranks or more)
    "windows": 3,                  # timing windows the level is the median of
    "cpu_contention": 0.25,        # cause evidence thresholds
    "data_wait": 0.5,
    "storage_probe_seconds": 0.5,  # a storage probe this slow makes data wait a storage cause
}


@dataclass
class AgentConfig:
    """The validated configuration the daemon runs with."""

    listen: str = AGENT_LISTEN
    # TRAINWATCH_NODE (e.g. the Kubernetes node name) wins over the hostname.
    node: str = field(default_factory=node_name)
    run_dirs: list[str] = field(default_factory=list)
    discover: list[str] = field(default_factory=list)
    sys_root: str = "/sys"
    proc_root: str = "/proc"
    collectors: dict[str, dict[str, Any]] = field(default_factory=dict)
    stall: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(STALL_DEFAULTS))
    straggler: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(STRAGGLER_DEFAULTS))
    file: str | None = None

    @property
    def host_port(self) -> tuple[str, int]:
        return parse_listen(self.listen, file=self.file)

    def collector(self, name: str) -> dict[str, Any]:
        return self.collectors[name]


def parse_listen(text: str, *, file: str | None = None) -> tuple[str, int]:
    host, sep, port = str(text).rpartition(":")
    if not sep or not host:
        raise ConfigError(f"listen address {text!r} is not HOST:PORT", file=file or "--listen",
                          key="listen")
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        raise ConfigError(f"listen port {port!r} is not a number 0-65535",
                          file=file or "--listen", key="listen")
    return host.strip("[]"), number


def _number(value: Any, file: str | None, key: str, *, minimum: float = 0.0,
            positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"must be a number, got {value!r}", file=file, key=key)
    if positive and value <= 0:
        raise ConfigError(f"must be > 0, got {value!r}", file=file, key=key)
    if value < minimum:
        raise ConfigError(f"must be >= {minimum:g}, got {value!r}", file=file, key=key)
    return float(value)


def _check_type(value: Any, expected: Any, file: str | None, key: str) -> Any:
    """Validate one option against the type of its default value."""
    if isinstance(expected, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"must be true or false, got {value!r}", file=file, key=key)
        return value
    if isinstance(expected, (int, float)):
        return _number(value, file, key)
    if isinstance(expected, str) or expected is None:
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"must be a string, got {value!r}", file=file, key=key)
        return value
    if isinstance(expected, list):
        if not isinstance(value, list):
            raise ConfigError(f"must be a list, got {type(value).__name__}", file=file, key=key)
        return value
    if isinstance(expected, dict):
        if not isinstance(value, dict):
            raise ConfigError(f"must be a mapping, got {type(value).__name__}", file=file,
                              key=key)
        return value
    return value


def _merge_section(defaults: dict[str, Any], given: Any, file: str | None,
                   section: str) -> dict[str, Any]:
    if given is None:
        return copy.deepcopy(defaults)
    if not isinstance(given, dict):
        raise ConfigError(f"must be a mapping, got {type(given).__name__}", file=file,
                          key=section)
    merged = copy.deepcopy(defaults)
    for key, value in given.items():
        full = f"{section}.{key}"
        if key not in defaults:
            raise ConfigError(f"unknown key (known: {', '.join(sorted(defaults))})", file=file,
                              key=full)
        merged[key] = _check_type(value, defaults[key], file, full)
    return merged


def build_config(data: dict[str, Any], *, file: str | None = None) -> AgentConfig:
    """Validate a config mapping (already parsed) against the registered collectors."""
    from trainwatch.agent.registry import all_collectors

    known = {"listen", "node", "run_dirs", "discover", "sys_root", "proc_root", "collectors",
             "stall", "straggler"}
    for key in data:
        if key not in known:
            raise ConfigError(f"unknown key (known: {', '.join(sorted(known))})", file=file,
                              key=str(key))
    cfg = AgentConfig(file=file)
    if "listen" in data:
        cfg.listen = str(data["listen"])
        parse_listen(cfg.listen, file=file)
    if data.get("node"):
        cfg.node = _check_type(data["node"], "", file, "node")
    for key in ("run_dirs", "discover"):
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError("must be a list of paths", file=file, key=key)
        setattr(cfg, key, list(value))
    for key in ("sys_root", "proc_root"):
        if key in data:
            setattr(cfg, key, _check_type(data[key], "", file, key) or getattr(cfg, key))

    cfg.stall = _merge_section(STALL_DEFAULTS, data.get("stall"), file, "stall")
    for key in ("floor_seconds", "k", "first_step_seconds", "heartbeat_stale_seconds"):
        _number(cfg.stall[key], file, f"stall.{key}", positive=True)
    for phase, seconds in cfg.stall["phase_budgets"].items():
        _number(seconds, file, f"stall.phase_budgets.{phase}", positive=True)
    cfg.straggler = _merge_section(STRAGGLER_DEFAULTS, data.get("straggler"), file, "straggler")
    if cfg.straggler["ratio"] <= 1.0:
        raise ConfigError("must be > 1 (a ratio to the median)", file=file, key="straggler.ratio")
    if not 1.0 <= cfg.straggler["clear_ratio"] <= cfg.straggler["ratio"]:
        raise ConfigError("must be between 1 and straggler.ratio (hysteresis)", file=file,
                          key="straggler.clear_ratio")
    for key in ("windows", "min_ranks_for_score"):
        if int(cfg.straggler[key]) != cfg.straggler[key] or cfg.straggler[key] < 1:
            raise ConfigError("must be a whole number >= 1", file=file, key=f"straggler.{key}")
        cfg.straggler[key] = int(cfg.straggler[key])

    sections = data.get("collectors") or {}
    if not isinstance(sections, dict):
        raise ConfigError("must be a mapping of collector name to options", file=file,
                          key="collectors")
    registered = all_collectors()
    for name in sections:
        if name not in registered:
            raise ConfigError(f"unknown collector (known: {', '.join(sorted(registered))})",
                              file=file, key=f"collectors.{name}")
    for name, spec in registered.items():
        defaults = {"enabled": spec.default_enabled, "interval": spec.interval,
                    "timeout": spec.timeout, **copy.deepcopy(spec.options)}
        merged = _merge_section(defaults, sections.get(name), file, f"collectors.{name}")
        _number(merged["interval"], file, f"collectors.{name}.interval", positive=True)
        _number(merged["timeout"], file, f"collectors.{name}.timeout", positive=True)
        cfg.collectors[name] = merged
    return cfg


def load_config(path: str | Path | None, *, run_dirs: list[str] | tuple[str, ...] = (),
                discover: list[str] | tuple[str, ...] = (),
                listen: str | None = None) -> AgentConfig:
    """Load the YAML file (if any) and apply command-line values on top."""
    data: dict[str, Any] = load_yaml_mapping(path) if path else {}
    cfg = build_config(data, file=str(path) if path else None)
    if run_dirs:
        cfg.run_dirs = list(run_dirs)
    if discover:
        cfg.discover = list(discover)
    if listen:
        cfg.listen = listen
        parse_listen(listen)
    if not cfg.run_dirs and not cfg.discover:
        raise ConfigError("no run directory to watch: give --run-dir or --discover "
                          "(or run_dirs / discover in the config)", file=cfg.file,
                          key="run_dirs")
    return cfg
