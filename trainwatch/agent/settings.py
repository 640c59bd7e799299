"""The agent config file's models (pydantic): imported only when a config mapping is
validated, never by an agent running without a file.

Pydantic and these models are ~10 MiB of the agent's resident memory (import, model
classes, core schemas). An agent given only ``--run-dir`` runs on the defaults, which
``trainwatch.agent.config.default_settings`` writes without them (a test pins both to
the same mapping); a config file (at start or on SIGHUP) is validated here.
"""

from __future__ import annotations

import copy
import functools
from typing import Annotated, Any, ClassVar, Optional

from pydantic import (AfterValidator, BeforeValidator, Field, WithJsonSchema, create_model,
                      model_validator)

from trainwatch.agent.config import STRAGGLER_DEFAULTS, parse_listen
from trainwatch.config.model import ConfigModel, Count, KeyProblem, Number
from trainwatch.contract.ports import AGENT_LISTEN
from trainwatch.contract.stall import STALL_DEFAULTS
from trainwatch.errors import ConfigError


def _positive(value: Any) -> Any:
    if value <= 0:
        raise ValueError(f"must be > 0, got {value!r}")
    return value


def _whole(value: Any) -> Any:
    """3.0 is the whole number 3 (YAML writes either); 1.5 stays and fails as not whole."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _no_none(value: Any) -> Any:
    """A section written with nothing under it (``stall:``) keeps its defaults."""
    return {} if value is None else value


Seconds = Annotated[Number, AfterValidator(_positive),
                    WithJsonSchema({"type": "number", "exclusiveMinimum": 0})]
Whole = Annotated[int, BeforeValidator(_whole), Field(ge=1)]
Section = BeforeValidator(_no_none)


class StallSettings(ConfigModel):
    """The stall rule's options (the rule itself: ``trainwatch.contract.stall``)."""

    floor_seconds: Seconds = STALL_DEFAULTS["floor_seconds"]
    k: Seconds = STALL_DEFAULTS["k"]
    first_step_seconds: Seconds = STALL_DEFAULTS["first_step_seconds"]
    heartbeat_stale_seconds: Seconds = STALL_DEFAULTS["heartbeat_stale_seconds"]
    phase_budgets: dict[str, Seconds] = Field(
        default_factory=lambda: dict(STALL_DEFAULTS["phase_budgets"]))
    history: Number = STALL_DEFAULTS["history"]


class StragglerSettings(ConfigModel):
    """When a rank or node is flagged slow (``agent/straggler.py``)."""

    ratio: Annotated[float, Field(gt=1)] = STRAGGLER_DEFAULTS["ratio"]
    clear_ratio: Number = STRAGGLER_DEFAULTS["clear_ratio"]
    noise_sigmas: Number = STRAGGLER_DEFAULTS["noise_sigmas"]
    score: Number = STRAGGLER_DEFAULTS["score"]
    min_ranks_for_score: Whole = STRAGGLER_DEFAULTS["min_ranks_for_score"]
    windows: Whole = STRAGGLER_DEFAULTS["windows"]
    cpu_contention: Number = STRAGGLER_DEFAULTS["cpu_contention"]
    data_wait: Number = STRAGGLER_DEFAULTS["data_wait"]
    storage_probe_seconds: Number = STRAGGLER_DEFAULTS["storage_probe_seconds"]

    @model_validator(mode="after")
    def _hysteresis(self) -> "StragglerSettings":
        if not 1.0 <= self.clear_ratio <= self.ratio:
            raise KeyProblem("clear_ratio", "must be between 1 and straggler.ratio (hysteresis)")
        return self


class CollectorSettings(ConfigModel):
    """The keys every collector takes; its own options are added per collector."""

    enabled: bool = True
    interval: Seconds = 1.0
    timeout: Seconds = 1.0


class CollectorsBase(ConfigModel):
    unknown_noun: ClassVar[str] = "collector"


def _option_type(default: Any) -> Any:
    """A collector option's type is the type of its default."""
    if isinstance(default, bool):
        return bool
    if isinstance(default, int):
        return Count
    if isinstance(default, float):
        return Number
    if isinstance(default, list):
        return list[Any]
    if isinstance(default, dict):
        return dict[str, Any]
    return Optional[str]


def _listen(value: str) -> str:
    try:
        parse_listen(value)
    except ConfigError as exc:
        raise ValueError(exc.problem) from None
    return value


def _paths(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


def _no_empty_path(value: list[str]) -> list[str]:
    if any(not path.strip() for path in value):  # "" would be the working directory
        raise ValueError("holds an empty path; give a folder ('.' for the current one)")
    return value


class AgentSettingsBase(ConfigModel):
    """The agent's config file (``trainwatch agent --config``); every key is optional.
    ``collectors`` is added per registered collector by ``agent_settings_model()``."""

    listen: Annotated[str, AfterValidator(_listen)] = AGENT_LISTEN
    node: Optional[str] = None
    run_dirs: Annotated[list[str], BeforeValidator(_paths), AfterValidator(_no_empty_path)] = \
        Field(default_factory=list)
    discover: Annotated[list[str], BeforeValidator(_paths), AfterValidator(_no_empty_path)] = \
        Field(default_factory=list)
    sys_root: str = "/sys"
    proc_root: str = "/proc"
    stall: Annotated[StallSettings, Section] = Field(default_factory=StallSettings)
    straggler: Annotated[StragglerSettings, Section] = Field(default_factory=StragglerSettings)


def agent_settings_model() -> type[ConfigModel]:
    """The agent config file's model: fixed sections plus one per registered collector.

    Built again when the registered collectors change (one registered after the first
    config was read must still get its section)."""
    from trainwatch.agent.registry import all_collectors

    specs = all_collectors()
    return _settings_model(tuple((name, id(spec)) for name, spec in sorted(specs.items())))


@functools.cache
def _settings_model(registered: tuple[tuple[str, int], ...]) -> type[ConfigModel]:
    from trainwatch.agent.registry import all_collectors

    specs = all_collectors()
    sections: dict[str, Any] = {}
    for name, _ in registered:
        spec = specs[name]
        fields: dict[str, Any] = {
            "enabled": (bool, spec.default_enabled),
            "interval": (Seconds, spec.interval),
            "timeout": (Seconds, spec.timeout),
            **{key: (_option_type(default), Field(default_factory=functools.partial(
                copy.deepcopy, default))) for key, default in spec.options.items()}}
        model = create_model(f"{name.title()}Collector", __base__=CollectorSettings, **fields)
        sections[name] = (Annotated[model, Section], Field(default_factory=model))
    collectors = create_model("Collectors", __base__=CollectorsBase, **sections)
    section: Any = (Annotated[collectors, Section], Field(default_factory=collectors))
    return create_model("AgentSettings", __base__=AgentSettingsBase, collectors=section)
