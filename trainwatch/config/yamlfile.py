"""Loading YAML config files with errors that name the file, line and key."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from trainwatch.errors import ConfigError
from trainwatch.rundir.safe_read import SkippedFile, read_run_file


MAX_CONFIG_BYTES = 16 << 20  # far above any real config; a mistaken path fails fast
# Nodes a document may hold with its aliases expanded: the packaged rules are ~2,000; a
# "billion laughs" file of 300 bytes expands to 9**9 and took gigabytes to walk.
MAX_YAML_NODES = 100_000
_MERGE_KEY = "tag:yaml.org,2002:merge"
# libyaml's parser when PyYAML has it: ~100x faster on hostile input, and it refuses
# nesting deeper than 1000 levels itself (the pure-Python one takes seconds to recurse out).
_PARSER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _duplicate_key(node: yaml.Node) -> yaml.Node | None:
    """The second of two equal keys of a mapping: YAML forbids them, and PyYAML would
    silently keep the last (a second ``stall:`` section drops the first)."""
    seen: set[tuple[str, str]] = set()
    for key, _ in node.value:
        if isinstance(key, yaml.ScalarNode) and key.tag != _MERGE_KEY:
            if (key.tag, key.value) in seen:
                return key
            seen.add((key.tag, key.value))
    return None


def check_yaml_document(root: yaml.Node) -> None:
    """Refuse a document whose aliases expand past ``MAX_YAML_NODES`` nodes or into
    themselves, or with a duplicate key, before anything walks it: every reader of the
    parsed value (validation, the line finder) pays for the expanded size. Linear in the
    document's own nodes (an alias's size is counted once)."""
    sizes: dict[int, int] = {}
    started: set[int] = set()  # on the path from the root: reaching one again is a loop
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            started.discard(key)
            sizes[key] = 1 + sum(sizes[id(child)] for child in _children(node))
            if sizes[key] > MAX_YAML_NODES:
                raise yaml.MarkedYAMLError(
                    problem=f"aliases expand to more than {MAX_YAML_NODES:,} nodes",
                    problem_mark=node.start_mark)
            continue
        if key in sizes:
            continue
        if key in started:
            raise yaml.MarkedYAMLError(problem="an alias refers to its own node",
                                       problem_mark=node.start_mark)
        if isinstance(node, yaml.MappingNode) and (twice := _duplicate_key(node)) is not None:
            raise yaml.MarkedYAMLError(problem=f"duplicate key '{twice.value}'",
                                       problem_mark=twice.start_mark)
        started.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in sizes)


class _CheckedLoader(_PARSER):  # type: ignore[valid-type,misc]
    """The safe loader (``yaml.load``, ``yaml.compose``) that checks each document's
    size and keys as it is composed (``check_yaml_document``)."""

    def get_single_node(self) -> yaml.Node | None:
        node = super().get_single_node()
        if node is not None:
            check_yaml_document(node)
        return node


YAML_LOADER = _CheckedLoader


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
