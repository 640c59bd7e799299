"""Preflight thresholds: the commented defaults file, a user's file on top, validated.

The defaults file (``defaults.yaml``, shipped in the package) is the schema: a key it
does not have is an error, and each value must have the type of its default, so a
typo in a cluster-wide config fails loudly (file, key, problem -> exit 2) instead of
silently checking against the default.
"""

from __future__ import annotations

import copy
import re
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from trainwatch.configfile import load_yaml_mapping
from trainwatch.errors import ConfigError

# Names --expect-version / software.expect_versions may pin.
VERSION_NAMES = ("torch", "torch_cuda", "nccl", "cuda", "driver", "python", "trainwatch")
_INT_LISTS = {"gpu.xid_ignore"}
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


def _value(key: str, value: Any, default: Any, file: str | None) -> Any:
    """``value`` checked against the type of ``default``."""
    if key == "gpu.expect_count":
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise ConfigError(f"must be a whole number >= 0 or null, got {value!r}", file=file,
                              key=key)
        return value
    if key.endswith("_bytes"):
        return parse_size(value, file=file, key=key)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"must be true or false, got {value!r}", file=file, key=key)
        return value
    if isinstance(default, (int, float)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f"must be a number >= 0, got {value!r}", file=file, key=key)
        if key.endswith("_ratio") and value > 1:
            raise ConfigError(f"must be a ratio between 0 and 1, got {value!r}", file=file,
                              key=key)
        return value
    if isinstance(default, str):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"must be a non-empty string, got {value!r}", file=file, key=key)
        return value
    if isinstance(default, list):
        item = int if key in _INT_LISTS else str
        if not isinstance(value, list) or not all(
                isinstance(v, item) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"must be a list of {item.__name__}s, got {value!r}", file=file,
                              key=key)
        if key == "host.trainer_patterns":
            for pattern in value:
                try:
                    re.compile(pattern)
                except re.error as exc:
                    raise ConfigError(f"bad regular expression {pattern!r}: {exc}", file=file,
                                      key=key) from None
        return value
    if isinstance(default, dict):
        if not isinstance(value, dict) or not all(
                isinstance(v, (str, int, float)) and not isinstance(v, bool)
                for v in value.values()):
            raise ConfigError(f"must be a mapping of names to values, got {value!r}",
                              file=file, key=key)
        if key == "software.expect_versions":
            check_version_names(value, file=file, key=key)
        return {str(k): str(v) for k, v in value.items()}
    return value


def check_version_names(pins: dict[str, Any], *, file: str | None, key: str) -> None:
    for name in pins:
        if name not in VERSION_NAMES:
            raise ConfigError(f"cannot pin '{name}' (known: {', '.join(VERSION_NAMES)})",
                              file=file, key=key)


def merge(defaults: dict[str, Any], given: dict[str, Any], file: str | None,
          prefix: str = "") -> dict[str, Any]:
    """Defaults with ``given`` on top, every key and value validated."""
    merged = copy.deepcopy(defaults)
    for key, value in given.items():
        full = f"{prefix}{key}"
        if key not in defaults:
            raise ConfigError(f"unknown key (known: {', '.join(sorted(defaults))})", file=file,
                              key=full)
        default = defaults[key]
        if isinstance(default, dict) and default and not prefix:  # a section
            if value is None:  # "gpu:" with nothing under it
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"must be a mapping, got {type(value).__name__}", file=file,
                                  key=full)
            merged[key] = merge(default, value, file, f"{full}.")
        else:
            merged[key] = _value(full, value, default, file)
    return merged


def load_settings(path: str | Path | None) -> dict[str, Any]:
    """The defaults, with the file at ``path`` (if any) on top."""
    defaults = _normalise(yaml.safe_load(defaults_text()))
    if path is None:
        return defaults
    return merge(defaults, load_yaml_mapping(path), str(path))


def _normalise(settings: dict[str, Any]) -> dict[str, Any]:
    """Size strings of the defaults file as bytes."""
    for section in settings.values():
        if isinstance(section, dict):
            for key, value in section.items():
                if key.endswith("_bytes"):
                    section[key] = parse_size(value, file="defaults.yaml", key=key)
    return settings
