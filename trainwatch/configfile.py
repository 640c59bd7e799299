"""Loading YAML config files with errors that name the file, line and key."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from trainwatch.errors import ConfigError


def read_config_text(path: str | Path) -> str:
    """A config file's text; a missing or unreadable file is a ConfigError naming it."""
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError("file not found", file=str(path)) from None
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", file=str(path)) from None


def yaml_error(exc: yaml.YAMLError, path: str | Path) -> ConfigError:
    """A YAML syntax error as a ConfigError with file and line."""
    mark = getattr(exc, "problem_mark", None)
    line = mark.line + 1 if mark is not None else None
    problem = getattr(exc, "problem", None) or str(exc)
    return ConfigError(f"invalid YAML: {problem}", file=str(path), line=line)


def load_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """Read a YAML file whose top level must be a mapping (empty file -> {})."""
    path = Path(path)
    text = read_config_text(path)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise yaml_error(exc, path) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"top level must be a mapping, got {type(data).__name__}",
                          file=str(path))
    return data


def parse_override(text: str) -> tuple[str, Any]:
    """Parse one ``--set key=value`` override; the value is read as YAML (so 3 is int)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override '{text}' is not of the form key=value", file="--set")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def read_secret(token_file: str | None, env: str, missing: str) -> str:
    """A token from ``--token-file``, else from the environment variable ``env`` (never
    from the command line, where ``ps`` would show it); ``missing`` says what to do."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the token file: {exc.strerror}", file=token_file,
                              key="--token-file") from None
        if not token:
            raise ConfigError("the token file is empty", file=token_file, key="--token-file")
        return token
    token = os.environ.get(env, "").strip()
    if not token:
        raise ConfigError(missing)
    return token
