"""Loading YAML config files with errors that name the file, line and key."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from trainwatch.errors import ConfigError
from trainwatch.rundir import SkippedFile, read_run_file


MAX_CONFIG_BYTES = 16 << 20  # far above any real config; a mistaken path fails fast
# libyaml's parser when PyYAML has it: ~100x faster on hostile input, and it refuses
# nesting deeper than 1000 levels itself (the pure-Python one takes seconds to recurse out).
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_config_text(path: str | Path) -> str:
    """A config file's text; a missing, unreadable, special (a FIFO must not hang us),
    huge or non-UTF-8 file is a ConfigError naming it."""
    try:
        data = read_run_file(path, max_bytes=MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise ConfigError("file not found", file=str(path)) from None
    except SkippedFile as exc:
        raise ConfigError(f"cannot read: {exc.detail}", file=str(path)) from None
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror or exc}", file=str(path)) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ConfigError(f"not UTF-8 text (byte {exc.start})", file=str(path),
                          line=line) from None


def yaml_error(exc: Exception, path: str | Path) -> ConfigError:
    """A YAML error (syntax, or a value PyYAML cannot build) as a ConfigError with file
    and line."""
    mark = getattr(exc, "problem_mark", None)
    line = mark.line + 1 if mark is not None else None
    problem = getattr(exc, "problem", None) or str(exc)
    return ConfigError(f"invalid YAML: {problem}", file=str(path), line=line)


def safe_load_yaml(text: str, where: str | Path) -> Any:
    """``yaml.safe_load`` whose every failure is a ConfigError naming ``where``: syntax
    errors, nesting deeper than the parser recurses, and scalars PyYAML cannot build
    (``2001-02-30`` raises ValueError in its timestamp constructor)."""
    try:
        return yaml.load(text, Loader=YAML_LOADER)  # a safe loader
    except yaml.YAMLError as exc:
        raise yaml_error(exc, where) from None
    except RecursionError:
        raise ConfigError("invalid YAML: nested too deeply", file=str(where)) from None
    except (ValueError, TypeError, OverflowError) as exc:
        raise ConfigError(f"invalid YAML value: {exc}", file=str(where)) from None


def load_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """Read a YAML file whose top level must be a mapping (empty file -> {})."""
    path = Path(path)
    text = read_config_text(path)
    data = safe_load_yaml(text, path)
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
        value = yaml.load(raw, Loader=YAML_LOADER) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    except (RecursionError, ValueError, TypeError, OverflowError) as exc:
        raise ConfigError(f"value of '{key}' is not usable: {type(exc).__name__}",
                          file="--set", key=key) from None
    return key, value


def read_secret(token_file: str | None, env: str, missing: str) -> str:
    """A token from ``--token-file``, else from the environment variable ``env`` (never
    from the command line, where ``ps`` would show it); ``missing`` says what to do."""
    if token_file:
        try:
            token = read_run_file(token_file, max_bytes=64 << 10).decode().strip()
        except (OSError, SkippedFile, UnicodeDecodeError) as exc:
            why = getattr(exc, "detail", None) or getattr(exc, "strerror", None) or "not text"
            raise ConfigError(f"cannot read the token file: {why}", file=token_file,
                              key="--token-file") from None
        if not token:
            raise ConfigError("the token file is empty", file=token_file, key="--token-file")
        return token
    token = os.environ.get(env, "").strip()
    if not token:
        raise ConfigError(missing)
    return token
