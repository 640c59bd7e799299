"""Preflight thresholds: the commented defaults file, a user's file on top, validated.

The defaults file (``defaults.yaml``, shipped in the package) holds every value; the
models here hold every type and range, so a typo in a cluster-wide config fails loudly
(file, key, line, problem -> exit 2) instead of silently checking against the default.
"""

from __future__ import annotations

import copy
import re
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Optional, Union

import yaml
from pydantic import AfterValidator, BeforeValidator, Field, WithJsonSchema

from trainwatch.config.yamlfile import load_yaml_mapping
from trainwatch.config.model import ConfigModel, Number, validate, yaml_lines
from trainwatch.errors import ConfigError

# Names --expect-version / software.expect_versions may pin.
VERSION_NAMES = ("torch", "torch_cuda", "nccl", "cuda", "driver", "python", "trainwatch")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)b?\s*$", re.I)


def defaults_text() -> str:
    return resources.files("trainwatch.preflight").joinpath("defaults.yaml").read_text()


def parse_size(value: Any, *, file: str | None, key: str) -> int:
    """Bytes from an int or a string like ``10GiB`` / ``500M`` (k/M/G/T/P; ``i``: powers of 1024)."""
    if isinstance(value, bool):
        raise ConfigError(f"must be a size (bytes, or e.g. 10GiB), got {value!r}", file=file,
                          key=key)
    if isinstance(value, (int, float)) and value >= 0:
        return int(value)
    match = _SIZE.match(value) if isinstance(value, str) else None
    if not match:
        raise ConfigError(f"must be a size (bytes, or e.g. 10GiB), got {value!r}", file=file,
                          key=key)
    number, prefix, binary = match.groups()
    power = " kmgtp".index(prefix.lower() or " ")
    return int(float(number) * (1024 if binary else 1000) ** power)


def check_version_names(pins: dict[str, Any], *, file: str | None, key: str) -> None:
    for name in pins:
        if name not in VERSION_NAMES:
            raise ConfigError(f"cannot pin '{name}' (known: {', '.join(VERSION_NAMES)})",
                              file=file, key=key)


def _size(value: Any) -> Any:
    try:
        return parse_size(value, file=None, key="")
    except ConfigError as exc:
        raise ValueError(exc.problem) from None


def _ratio(value: float) -> float:
    if value > 1:
        raise ValueError(f"must be a ratio between 0 and 1, got {value!r}")
    return value


def _patterns(value: list[str]) -> list[str]:
    for pattern in value:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"bad regular expression {pattern!r}: {exc}") from None
    return value


def _pins(value: dict[str, Any]) -> dict[str, Any]:
    unknown = [name for name in value if name not in VERSION_NAMES]
    if unknown:
        raise ValueError(f"cannot pin '{unknown[0]}' (known: {', '.join(VERSION_NAMES)})")
    return value


def _as_text(value: dict[str, Any]) -> dict[str, str]:
    return {str(k): str(v) for k, v in value.items()}


Ratio = Annotated[Number, AfterValidator(_ratio),
                  WithJsonSchema({"type": "number", "minimum": 0, "maximum": 1})]
Size = Annotated[int, BeforeValidator(_size), WithJsonSchema({"anyOf": [
    {"type": "integer", "minimum": 0},
    {"type": "string", "pattern": _SIZE.pattern}]})]
Text = Annotated[str, Field(min_length=1)]
Values = Annotated[dict[str, Union[str, int, float]], AfterValidator(_as_text)]


class GpuSettings(ConfigModel):
    expect_count: Optional[Annotated[int, Field(ge=0)]]
    xid_watch_seconds: Number
    xid_ignore: list[int]
    warn_temperature_celsius: Number
    max_temperature_celsius: Number
    fail_clock_events: list[str]
    warn_clock_events: list[str]
    max_memory_used_ratio: Ratio


class SdcSettings(ConfigModel):
    suspect_dirs: list[Text]


class StorageSettings(ConfigModel):
    probe_bytes: Size
    probe_timeout_seconds: Number
    min_free_bytes: Size
    warn_free_ratio: Ratio
    min_free_inodes: Number
    checkpoint_room: Number
    data_dir_writable: bool


class HostSettings(ConfigModel):
    shm_path: Text
    min_shm_bytes: Size
    fail_nofile_below: Number
    warn_nofile_below: Number
    fail_available_memory_bytes: Size
    warn_available_memory_ratio: Ratio
    trainer_patterns: Annotated[list[str], AfterValidator(_patterns)]


class NetworkSettings(ConfigModel):
    connect_timeout_seconds: Number
    warn_connect_seconds: Number
    ignore_interfaces: list[str]
    ignore_virtual: bool
    require_interfaces: list[str]
    require_ib_ports: list[str]
    warn_clock_offset_seconds: Number
    fail_clock_offset_seconds: Number


class SoftwareSettings(ConfigModel):
    expect_versions: Annotated[Values, AfterValidator(_pins)]
    expect_env: Values
    env_prefixes: list[str]
    import_timeout_seconds: Number


class PreflightSettings(ConfigModel):
    """A preflight config file: every key optional in the user's file, the values of keys
    left out come from ``defaults.yaml`` (the one home of the defaults)."""

    sys_root: Text
    proc_root: Text
    gpu: GpuSettings
    sdc: SdcSettings
    storage: StorageSettings
    host: HostSettings
    network: NetworkSettings
    software: SoftwareSettings


def _on_top(defaults: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """``given`` over ``defaults``, section by section; a section left empty keeps its
    defaults, anything else (a typo, a scalar) goes to the model to be named."""
    merged = copy.deepcopy(defaults)
    for key, value in given.items():
        if isinstance(merged.get(key), dict) and value is None:
            continue
        if isinstance(merged.get(key), dict) and isinstance(value, dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def load_settings(path: str | Path | None) -> dict[str, Any]:
    """The defaults, with the file at ``path`` (if any) on top."""
    defaults = yaml.safe_load(defaults_text())
    if path is None:
        return validate(PreflightSettings, defaults, file="defaults.yaml").model_dump()
    merged = _on_top(defaults, load_yaml_mapping(path))
    return validate(PreflightSettings, merged, file=str(path),
                    lines=yaml_lines(path)).model_dump()
