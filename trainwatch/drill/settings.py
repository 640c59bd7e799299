"""What a drill runs with: alert thresholds, agent config and trainer config, written into the
drill's run directory (``RUN_DIR/drill/``) so that the run can be inspected and repeated.

Production defaults wait minutes before paging (``stall_for: 1m``, ``straggler_for: 10m``);
a drill shortens those waits, and says which ones (``changed_defaults``), so that its
time-to-detect measures the machinery, not the patience of a threshold.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from trainwatch.config.model import validate
from trainwatch.drill.catalog import Drill
from trainwatch.errors import ConfigError

THRESHOLDS = {"evaluation_interval": "1s", "stall_for": "2s"}
AGENT = {"stall": {"floor_seconds": 3, "heartbeat_stale_seconds": 3},
         "collectors": {"ranks": {"interval": 0.5},
                        # a drill's job ends seconds after its fault: its link series must
                        # show a slow link by then (slow_network_link)
                        "links": {"interval": 1.0}}}
# The tiny model of the e2e tests: a step is tens of milliseconds on a CPU core.
TRAINER = {"train": {"batch_size": 4, "eval_interval": 1000},
           "data": {"corpus_bytes": 20000},
           "telemetry": {"heartbeat_interval": 0.2},
           # every step: the tiny model's CPU step (~50 ms) is too short for the 1 % rule of
           # memory_snapshots: auto, which would snapshot every few steps
           "checkpoint": {"every_steps": 10, "fsync": False, "memory_snapshots": "every_step"}}
# Steps a run needs after the fault to show detection and recovery at all.
MIN_STEPS_AFTER_FAULT = 5


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@dataclass
class DrillSettings:
    drill: Drill
    nproc_per_node: int
    steps: int
    detect_within: float
    recover_within: float | None
    thresholds: dict[str, Any]
    agent: dict[str, Any]
    trainer: dict[str, Any]

    @property
    def checkpoint_every(self) -> int:
        return int(self.trainer["checkpoint"]["every_steps"])

    @property
    def steps_lost_max(self) -> int:
        """1 where memory snapshots outlive the failure, else the checkpoint interval."""
        memory = self.trainer["checkpoint"].get("memory_snapshots", "auto") != "off"
        return 1 if memory and self.drill.memory_resume else self.checkpoint_every

    def to_json(self) -> dict[str, Any]:
        return {"nproc_per_node": self.nproc_per_node, "steps": self.steps,
                "max_restarts": self.drill.max_restarts, "fault_env": self.drill.fault_env(),
                "detect_within_seconds": self.detect_within,
                "recover_within_seconds": self.recover_within,
                "steps_lost_max": self.steps_lost_max,
                "checkpoint_every": self.checkpoint_every,
                "thresholds": self.thresholds, "agent": self.agent, "trainer": self.trainer,
                "changed_defaults": changed_defaults(self.drill)}


def settings_for(drill: Drill, *, nproc_per_node: int | None = None, steps: int | None = None,
                 detect_within: float | None = None,
                 recover_within: float | None = None) -> DrillSettings:
    """The drill's settings with the command line's overrides; impossible ones exit 2."""
    nproc_per_node = drill.nproc_per_node if nproc_per_node is None else nproc_per_node
    if nproc_per_node < drill.nproc_per_node:  # sdc: a majority of 3 names the odd replica
        raise ConfigError(f"drill {drill.name} needs at least {drill.nproc_per_node} ranks, "
                          f"got {nproc_per_node}", key="--nproc-per-node")
    if nproc_per_node < 2:
        raise ConfigError(f"must be at least 2 (drills fail rank {drill.fault_rank} and watch "
                          f"the others), got {nproc_per_node}", key="--nproc-per-node")
    if drill.fault_rank >= nproc_per_node:
        raise ConfigError(f"drill {drill.name} fails rank {drill.fault_rank}: needs more than "
                          f"{nproc_per_node} ranks", key="--nproc-per-node")
    steps = drill.steps if steps is None else steps
    if steps < drill.fault_step + MIN_STEPS_AFTER_FAULT:
        raise ConfigError(f"drill {drill.name} injects its fault at step {drill.fault_step}: "
                          f"needs at least {drill.fault_step + MIN_STEPS_AFTER_FAULT} steps, "
                          f"got {steps}", key="--steps")
    trainer = merged(TRAINER, drill.trainer)
    trainer["train"]["steps"] = steps
    thresholds, agent = merged(THRESHOLDS, drill.thresholds), merged(AGENT, drill.agent)
    _check(drill, thresholds, agent)
    return DrillSettings(
        drill=drill, nproc_per_node=nproc_per_node, steps=steps,
        detect_within=drill.detect_within if detect_within is None else detect_within,
        recover_within=drill.recover_within if recover_within is None else recover_within,
        thresholds=thresholds, agent=agent, trainer=trainer)


def _check(drill: Drill, thresholds: dict[str, Any], agent: dict[str, Any]) -> None:
    """The drill's thresholds and agent settings through the same typed models as the files
    a user writes, so a mistake in a drill fails before its run starts, naming the key."""
    from trainwatch.agent.config import agent_settings_model
    from trainwatch.alerts.rules import load_thresholds, thresholds_model

    validate(thresholds_model(), {**load_thresholds(), **thresholds},
             file=f"drill {drill.name} (thresholds)")
    validate(agent_settings_model(), agent, file=f"drill {drill.name} (agent)")


def write_files(settings: DrillSettings, folder: Path) -> dict[str, Path]:
    """thresholds.yaml, agent.yaml and train.yaml in ``folder``; their paths by name."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {"thresholds": settings.thresholds, "agent": settings.agent,
             "train": settings.trainer}
    paths = {}
    for name, content in files.items():
        paths[name] = folder / f"{name}.yaml"
        paths[name].write_text(f"# written by trainwatch drill {settings.drill.name}\n"
                               + yaml.safe_dump(content, sort_keys=False))
    return paths


def changed_defaults(drill: Drill | None = None) -> list[dict[str, Any]]:
    """Alert thresholds and agent settings a drill runs with that differ from the production
    defaults (alerts/thresholds.yaml, the agent's defaults): what the output must admit."""
    from trainwatch.agent.config import build_config
    from trainwatch.alerts.rules import load_thresholds

    thresholds = merged(THRESHOLDS, drill.thresholds if drill else {})
    agent = merged(AGENT, drill.agent if drill else {})
    defaults = load_thresholds()
    agent_defaults = build_config({})
    rows = [{"file": "thresholds", "key": key, "drill": value, "default": defaults.get(key)}
            for key, value in thresholds.items()]
    for section in ("stall", "straggler"):
        for key, value in agent.get(section, {}).items():
            rows.append({"file": "agent", "key": f"{section}.{key}", "drill": value,
                         "default": getattr(agent_defaults, section).get(key)})
    for name, options in agent.get("collectors", {}).items():
        for key, value in options.items():
            rows.append({"file": "agent", "key": f"collectors.{name}.{key}", "drill": value,
                         "default": agent_defaults.collector(name).get(key)})
    return [r for r in rows if r["drill"] != r["default"]]
