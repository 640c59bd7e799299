"""Typed config files: a pydantic model per file, errors as ConfigError naming file, key, line.

Every config a user writes (agent, preflight, drill, alert thresholds) is a pydantic model
with ``extra="forbid"``, so one mechanism checks types and ranges, rejects a typo'd key and
exports the JSON Schema editors complete from. Pydantic's own messages are rewritten here
into the project's wording ("must be a number, got 'fast'") and its error location into a
dotted key and the line of that key in the YAML file.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, PlainValidator, ValidationError, WithJsonSchema

from trainwatch.config.yamlfile import YAML_LOADER, load_yaml_mapping, read_config_text
from trainwatch.errors import ConfigError

Model = TypeVar("Model", bound=BaseModel)
Lines = dict[tuple[str, ...], int]



def _any_number(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > sys.float_info.max:
        # math.isfinite would raise OverflowError on it (a traceback, not exit 2)
        raise ValueError(f"must be a finite number, got an integer of {len(str(abs(value)))} "
                         "digits")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"must be a finite number, got {value!r}")
    return value


def _non_negative(value: Any) -> Any:
    if _any_number(value) < 0:
        raise ValueError(f"must be >= 0, got {value!r}")
    return value


# Numbers kept as written (an int stays an int in messages and output); one validator, not
# a union, so an error names the key and not a member of the union.
AnyNumber = Annotated[Union[int, float], PlainValidator(_any_number),
                      WithJsonSchema({"type": "number"})]
Number = Annotated[Union[int, float], PlainValidator(_non_negative),
                   WithJsonSchema({"type": "number", "minimum": 0})]

MAX_COUNT = 2**31 - 1  # fits every C size and index a count is handed to (deque, read)


def _count(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"must be a whole number, got {value!r}")
    if not 0 <= value <= MAX_COUNT:
        shown = repr(value) if abs(value) < 10**20 else f"an integer of {len(str(abs(value)))} digits"
        raise ValueError(f"must be between 0 and {MAX_COUNT:,}, got {shown}")
    return value


# A count or a size in bytes: bounded, so a typo's huge value is refused here and not by an
# OverflowError or MemoryError in a collector every second.
Count = Annotated[int, PlainValidator(_count),
                  WithJsonSchema({"type": "integer", "minimum": 0, "maximum": MAX_COUNT})]


class ConfigModel(BaseModel):
    """Base of every config section: unknown keys are errors, values are not coerced
    (``"3"`` is not a number, ``1`` is not ``true``)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class KeyProblem(ValueError):
    """Raised by a model's own validator to blame one key of the section it checks."""

    def __init__(self, key: str, problem: str):
        super().__init__(problem)
        self.key = key


def yaml_lines(path: str | Path) -> Lines:
    """The line (1-based) of every key and list item in a YAML file, by its path."""
    try:
        root = yaml.compose(read_config_text(path), Loader=YAML_LOADER)
    except (yaml.YAMLError, RecursionError):
        return {}
    lines: Lines = {}

    def walk(node: yaml.Node, where: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = where + (str(key_node.value),)
                lines[key] = key_node.start_mark.line + 1
                walk(value_node, key)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                lines[where + (str(index),)] = item.start_mark.line + 1
                walk(item, where + (str(index),))

    try:
        if root is not None:
            walk(root, ())
    except RecursionError:  # nested deeper than any config: the keys found so far will do
        pass
    return lines


def load_model(model: type[Model], path: str | Path) -> tuple[Model, dict[str, Any]]:
    """The file at ``path`` validated by ``model``; also the raw mapping it was read from."""
    data = load_yaml_mapping(path)
    return validate(model, data, file=str(path), lines=yaml_lines(path)), data


def validate(model: type[Model], data: Any, *, file: str | None = None,
             lines: Lines | None = None) -> Model:
    """``data`` validated by ``model``; the first problem as a ConfigError."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise config_error(model, exc.errors()[0], file=file, lines=lines or {}) from None


def config_error(model: type[BaseModel], error: Any, *, file: str | None,
                 lines: Lines) -> ConfigError:
    """One pydantic error as the project's ConfigError (file, dotted key, line, problem)."""
    loc = tuple(str(part) for part in error["loc"])
    ctx = error.get("ctx") or {}
    cause = ctx.get("error")
    if isinstance(cause, KeyProblem):
        loc = loc + (cause.key,)
    problem = _problem(model, error, loc)
    if loc and loc[-1].isdigit() and error["type"] in _ITEM_NOUNS:
        # A bad item is the list's problem: name the list, as a reader would.
        loc = loc[:-1]
        problem = f"must be a list of {_ITEM_NOUNS[error['type']]}, got item {error.get('input')!r}"
    line = None
    for end in range(len(loc), 0, -1):
        if loc[:end] in lines:
            line = lines[loc[:end]]
            break
    return ConfigError(problem, file=file, key=".".join(loc) or None, line=line)


_ITEM_NOUNS = {"int_type": "ints", "int_from_float": "ints", "string_type": "strs",
               "float_type": "numbers"}

_NUMBER = "must be a finite number, got {value!r}"
_WHOLE = "must be a whole number, got {value!r}"
_MAPPING = "must be a mapping, got {type}"
# pydantic error kind -> what a person reads after "key 'a.b':".
_MESSAGES = {
    "float_type": _NUMBER, "float_parsing": _NUMBER, "finite_number": _NUMBER,
    "int_type": _WHOLE, "int_parsing": _WHOLE, "int_from_float": _WHOLE,
    "bool_type": "must be true or false, got {value!r}",
    "string_too_short": "must be a non-empty string, got {value!r}",
    "string_type": "must be a string, got {value!r}",
    "list_type": "must be a list, got {type}",
    "dict_type": _MAPPING, "model_type": _MAPPING, "model_attributes_type": _MAPPING,
    "greater_than": "must be > {ctx[gt]}, got {value!r}",
    "greater_than_equal": "must be >= {ctx[ge]}, got {value!r}",
    "less_than_equal": "must be <= {ctx[le]}, got {value!r}",
}


def _problem(model: type[BaseModel], error: Any, loc: tuple[str, ...]) -> str:
    kind, value, ctx = error["type"], error.get("input"), error.get("ctx") or {}
    if kind == "extra_forbidden":
        parent = _model_at(model, loc[:-1])
        known = sorted(parent.model_fields) if parent else []
        noun = getattr(parent, "unknown_noun", "key") if parent else "key"
        return f"unknown {noun} (known: {', '.join(known)})"
    template = _MESSAGES.get(kind)
    if template is not None:
        return template.format(value=value, type=type(value).__name__, ctx=ctx)
    if kind == "value_error":
        return str(ctx.get("error") or error["msg"])
    return str(error["msg"])


def _model_at(model: type[BaseModel], loc: tuple[str, ...]) -> type[BaseModel] | None:
    """The model class that validates the mapping at ``loc`` (for its list of known keys)."""
    current: Any = model
    for part in loc:
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(part)
            if field is None:
                return None
            current = field.annotation
        elif get_origin(current) is dict:
            current = get_args(current)[1]
        else:
            return None
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def json_schema(model: Any, title: str, *,
                defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON Schema of a config model (or a dataclass) for editors (yaml-language-server).

    ``defaults``: the values of a config whose defaults live in a file of their own (a
    user's file holds only the keys it changes): no key is required, each shows its default."""
    from pydantic import TypeAdapter

    schema = TypeAdapter(model).json_schema(mode="validation")
    if defaults is not None:
        schema = _optional(schema)
        _add_defaults(schema, schema, defaults)
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}
    schema["title"] = title
    return schema


def _optional(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _optional(v) for k, v in node.items() if k != "required"}
    if isinstance(node, list):
        return [_optional(v) for v in node]
    return node


def _add_defaults(root: dict[str, Any], node: dict[str, Any], values: dict[str, Any]) -> None:
    if "$ref" in node:
        node = root["$defs"][node["$ref"].rsplit("/", 1)[1]]
    for key, prop in node.get("properties", {}).items():
        if key not in values:
            continue
        if isinstance(values[key], dict) and ("$ref" in prop or "properties" in prop):
            _add_defaults(root, prop, values[key])
        else:
            prop["default"] = values[key]
