"""Agent configuration: defaults, YAML loading and validation (file, key, problem -> exit 2).

Every key is optional. Collector sections take the common keys ``enabled``,
``interval`` and ``timeout`` plus the options the collector declares when it
registers (see ``agent/registry.py``), so a typo is an error, never ignored.
The models that validate a file are ``agent/settings.py``'s, imported only when there
is a file or mapping to validate: an agent on the defaults never loads pydantic, and
``trainwatch agent --config`` validates its file in a child (``agent/config_child.py``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from trainwatch.contract.ports import AGENT_LISTEN
from trainwatch.contract.stall import STALL_DEFAULTS
from trainwatch.errors import ConfigError
from trainwatch.node import node_name

if TYPE_CHECKING:
    from trainwatch.config.model import ConfigModel, Lines

STRAGGLER_DEFAULTS: dict[str, Any] = {
    "ratio": 1.15,                 # flag: level (median ratio of the last windows) >= ratio
    "clear_ratio": 1.07,           # ... and keep the flag until the level drops below this
    "noise_sigmas": 6.0,           # least evidence (in standard errors) a flag needs
    "score": 3.0,                  # flag needs a median robust z-score >= score too
    "min_ranks_for_score": 4,      # (worlds of this many ranks or more)
    "windows": 3,                  # timing windows the level is the median of (hysteresis)
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


def agent_settings_model() -> type[ConfigModel]:
    """The agent config file's model (``agent/settings.py``; JSON Schema, drills)."""
    from trainwatch.agent.settings import agent_settings_model as model
    return model()


def default_settings() -> dict[str, Any]:
    """What validating an empty mapping gives (the models' defaults), without the models."""
    from trainwatch.agent.registry import all_collectors

    return {"listen": AGENT_LISTEN, "node": None, "run_dirs": [], "discover": [],
            "sys_root": "/sys", "proc_root": "/proc",
            "stall": copy.deepcopy(STALL_DEFAULTS), "straggler": dict(STRAGGLER_DEFAULTS),
            "collectors": {name: {"enabled": spec.default_enabled, "interval": spec.interval,
                                  "timeout": spec.timeout, **copy.deepcopy(spec.options)}
                           for name, spec in sorted(all_collectors().items())}}


def build_config(data: dict[str, Any], *, file: str | None = None,
                 lines: Lines | None = None) -> AgentConfig:
    """Validate a config mapping (already parsed) against the registered collectors; an
    empty one (no file) is the defaults, and pydantic is not imported for it."""
    return config_of(validated(data, file=file, lines=lines), file=file)


def validated(data: dict[str, Any], *, file: str | None = None,
              lines: Lines | None = None) -> dict[str, Any]:
    """The settings a config mapping gives (``default_settings``' shape); ConfigError
    naming the file and key of the first problem."""
    if not data:
        return default_settings()
    from trainwatch.config.model import validate
    return validate(agent_settings_model(), data, file=file, lines=lines).model_dump()


def file_settings(path: str | Path) -> dict[str, Any]:
    """The settings the YAML file at ``path`` gives, validated in this process (pydantic
    and the models stay loaded: ``agent/config_child.py`` does it in a child instead)."""
    from trainwatch.config.yamlfile import load_yaml_mapping

    data = load_yaml_mapping(path)
    lines = None
    if data:
        from trainwatch.config.model import yaml_lines
        lines = yaml_lines(path)
    return validated(data, file=str(path), lines=lines)


def config_of(settings: dict[str, Any], *, file: str | None = None) -> AgentConfig:
    """The config the daemon runs with, from validated settings."""
    cfg = AgentConfig(file=file, listen=settings["listen"], run_dirs=settings["run_dirs"],
                      discover=settings["discover"], sys_root=settings["sys_root"],
                      proc_root=settings["proc_root"], collectors=settings["collectors"],
                      stall=settings["stall"], straggler=settings["straggler"])
    if settings["node"]:
        cfg.node = settings["node"]
    return cfg


def load_config(path: str | Path | None, *, run_dirs: list[str] | tuple[str, ...] = (),
                discover: list[str] | tuple[str, ...] = (), listen: str | None = None,
                read: Callable[[str | Path], dict[str, Any]] = file_settings) -> AgentConfig:
    """Load the YAML file (if any) and apply command-line values on top. ``read`` turns
    the file into settings (``file_settings``: here; the daemon's, in a child)."""
    cfg = config_of(read(path) if path else default_settings(),
                    file=str(path) if path else None)
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
