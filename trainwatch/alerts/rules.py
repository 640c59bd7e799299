"""Loading the one rules source (alerts/rules.yaml + alerts/thresholds.yaml).

Everything that can be wrong with a rule file is found here, before anything
runs, and reported as a ConfigError naming the file and line: YAML syntax,
unknown keys, unknown thresholds, bad durations, PromQL outside the supported
subset, metrics missing from the contract, templates the two engines would
render differently, and alerts without a runbook.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, ClassVar

import yaml
from pydantic import AfterValidator, create_model

from trainwatch.alerts import promql
from trainwatch.config.yamlfile import YAML_LOADER, read_config_text, yaml_error
from trainwatch.config.model import AnyNumber, ConfigModel, Lines, validate
from trainwatch.errors import ConfigError
from trainwatch.contract.alerts import ACTIONS, RULES_RESOURCE, SEVERITIES, THRESHOLDS_RESOURCE
from trainwatch.contract.metrics import METRICS

RULES_FILE = Path(__file__).with_name(RULES_RESOURCE)
THRESHOLDS_FILE = Path(__file__).with_name(THRESHOLDS_RESOURCE)
PREFIXES = ("Training", "Checkpoint", "GPU", "NCCL", "Storage", "Network", "Trainwatch")
# Series Prometheus makes itself (not exported by any trainwatch component).
PROMETHEUS_METRICS = {"up"}
RULE_KEYS = {"alert", "expr", "for", "keep_firing_for", "severity", "action", "summary",
             "description"}
DEFAULT_RUNBOOK_BASE = "https://github.com/trainwatch/trainwatch/blob/main/trainwatch/runbooks/"
# Keys of thresholds.yaml that are selectors, not durations: label values the user's Prometheus
# decides (the mixins' _config.*Selector). The scrape job of the agents (TrainwatchAgentDown,
# the self-monitoring dashboard, the embedded engine's own scrape):
AGENT_JOB = "agent_job"
SELECTOR_KEYS = (AGENT_JOB,)

_PLACEHOLDER = re.compile(r"\$\{([A-Za-z0-9_]+)\}")
_NAME = re.compile(r"^[A-Z][A-Za-z0-9]+$")
_TEMPLATE_ACTION = re.compile(r"\{\{(.*?)\}\}", re.S)
_ALLOWED_ACTIONS = (re.compile(r"^\s*\$labels\.([A-Za-z_][A-Za-z0-9_]*)\s*$"),
                    re.compile(r'^\s*printf\s+"%\.(\d)f"\s+\$value\s*$'))


@dataclass
class Rule:
    """One alert, fully resolved: thresholds substituted, expression parsed."""

    name: str
    group: str
    expr: str
    ast: object
    metrics: set[str]
    for_seconds: float
    keep_firing_seconds: float
    severity: str
    action: str | None
    summary: str
    description: str
    file: str
    line: int

    def runbook_url(self, base: str = DEFAULT_RUNBOOK_BASE) -> str:
        return f"{base}{self.name}.md"


@dataclass
class RuleSet:
    rules: list[Rule]
    thresholds: dict[str, Any]
    files: list[str] = field(default_factory=list)

    def get(self, name: str) -> Rule | None:
        return next((r for r in self.rules if r.name == name), None)

    @property
    def groups(self) -> dict[str, list[Rule]]:
        out: dict[str, list[Rule]] = {}
        for rule in self.rules:
            out.setdefault(rule.group, []).append(rule)
        return out


# --------------------------------------------------------------------------- YAML with lines

def _compose(path: Path) -> yaml.Node | None:
    text = read_config_text(path)
    try:
        return yaml.compose(text, Loader=YAML_LOADER)
    except yaml.YAMLError as exc:
        raise yaml_error(exc, path) from None
    except RecursionError:
        raise ConfigError("invalid YAML: nested too deeply", file=str(path)) from None


def _value(node: yaml.Node, path: Path) -> Any:
    """The Python value of a node; one PyYAML cannot build is a ConfigError at its line."""
    try:
        return yaml.SafeLoader("").construct_object(node, deep=True)
    except (yaml.YAMLError, ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise ConfigError(f"invalid YAML value: {exc}", file=str(path),
                          line=node.start_mark.line + 1) from None


def _mapping(node: yaml.Node, path: Path, what: str) -> list[tuple[str, yaml.Node, int]]:
    if not isinstance(node, yaml.MappingNode):
        raise ConfigError(f"{what} must be a mapping", file=str(path),
                          line=node.start_mark.line + 1)
    for k, _ in node.value:
        if not isinstance(k, yaml.ScalarNode):
            raise ConfigError(f"{what}: keys must be plain names", file=str(path),
                              line=k.start_mark.line + 1)
    return [(k.value, v, k.start_mark.line + 1) for k, v in node.value]


# --------------------------------------------------------------------------- thresholds

def _duration(value: str) -> str:
    try:
        promql.parse_duration(value)
    except ValueError as exc:
        raise ValueError(f"bad duration: {exc}") from None
    return value


Duration = Annotated[str, AfterValidator(_duration)]


def _label_value(value: str) -> str:
    # Spliced into a double-quoted PromQL matcher: a quote, backslash or newline would end it.
    if not value or any(c in value for c in '"\\\n'):
        raise ValueError("must be a non-empty label value without quotes, backslashes or "
                         "newlines")
    return value


LabelValue = Annotated[str, AfterValidator(_label_value)]


class ThresholdsBase(ConfigModel):
    unknown_noun: ClassVar[str] = "threshold"


def _default_thresholds() -> tuple[dict[str, Any], Lines]:
    values: dict[str, Any] = {}
    lines: Lines = {}
    root = _compose(THRESHOLDS_FILE)
    assert root is not None, "the packaged thresholds file is not empty"
    for key, node, line in _mapping(root, THRESHOLDS_FILE, "the thresholds file"):
        values[key] = _value(node, THRESHOLDS_FILE)
        lines[(key,)] = line
    return values, lines


@functools.cache
def thresholds_model() -> type[ConfigModel]:
    """A field per threshold of the package's thresholds.yaml (the one home of the values),
    typed by its value there: a Prometheus duration or a number; a selector is a label value."""
    defaults, _ = _default_thresholds()
    fields: dict[str, Any] = {
        key: (LabelValue if key in SELECTOR_KEYS else
              Duration if isinstance(value, str) else AnyNumber, ...)
        for key, value in defaults.items()}
    return create_model("Thresholds", __base__=ThresholdsBase, **fields)


def load_thresholds(override: str | Path | None = None) -> dict[str, Any]:
    """Defaults from the package, with ``override`` (only changed keys) on top."""
    values, lines = _default_thresholds()
    file = str(THRESHOLDS_FILE)
    if override is not None:
        path = Path(override)
        root = _compose(path)
        if root is not None:
            file, lines = str(path), {}
            for key, node, line in _mapping(root, path, "the thresholds file"):
                values[key] = _value(node, path)
                lines[(key,)] = line
    return validate(thresholds_model(), values, file=file, lines=lines).model_dump()


# --------------------------------------------------------------------------- rules

def load_rules(rules_file: str | Path | None = None,
               thresholds_file: str | Path | None = None,
               runbooks: set[str] | None = None) -> RuleSet:
    """Load and validate the rules; raises ConfigError (exit 2) on the first problem."""
    path = Path(rules_file) if rules_file else RULES_FILE
    thresholds = load_thresholds(thresholds_file)
    runbooks = available_runbooks() if runbooks is None else runbooks
    root = _compose(path)
    if root is None:
        raise ConfigError("empty rules file", file=str(path))
    top = dict((k, (v, line)) for k, v, line in _mapping(root, path, "the rules file"))
    if "groups" not in top:
        raise ConfigError("missing 'groups'", file=str(path), line=1)
    groups_node, groups_line = top["groups"]
    if not isinstance(groups_node, yaml.SequenceNode):
        raise ConfigError("'groups' must be a list", file=str(path), line=groups_line)
    rules: list[Rule] = []
    seen: dict[str, int] = {}
    for group_node in groups_node.value:
        group = dict((k, (v, line)) for k, v, line in _mapping(group_node, path, "a group"))
        gname = _value(group["name"][0], path) if "name" in group else None
        gline = group_node.start_mark.line + 1
        if not gname or "rules" not in group:
            raise ConfigError("a group needs 'name' and 'rules'", file=str(path), line=gline)
        rules_node = group["rules"][0]
        if not isinstance(rules_node, yaml.SequenceNode):
            raise ConfigError("'rules' must be a list", file=str(path), line=group["rules"][1])
        for rule_node in rules_node.value:
            rule = _load_rule(rule_node, gname, path, thresholds, runbooks)
            if rule.name in seen:
                raise ConfigError(f"alert {rule.name} is defined twice (first on line "
                                  f"{seen[rule.name]})", file=str(path), line=rule.line)
            seen[rule.name] = rule.line
            rules.append(rule)
    return RuleSet(rules, thresholds, [str(path)])


def _substitute(text: str, thresholds: dict[str, Any], path: Path, line: int, key: str) -> str:
    def repl(m: re.Match) -> str:
        name = m.group(1)
        if name not in thresholds:
            raise ConfigError(f"unknown threshold ${{{name}}} (see {THRESHOLDS_FILE.name})",
                              file=str(path), key=key, line=line)
        value = thresholds[name]
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return str(value)
    return _PLACEHOLDER.sub(repl, text)


def _load_rule(node: yaml.Node, group: str, path: Path, thresholds: dict[str, Any],
               runbooks: set[str]) -> Rule:
    items = _mapping(node, path, "a rule")
    line = node.start_mark.line + 1
    raw: dict[str, Any] = {}
    key_lines: dict[str, int] = {}
    for key, value_node, key_line in items:
        if key not in RULE_KEYS:
            raise ConfigError(f"unknown key (allowed: {', '.join(sorted(RULE_KEYS))})",
                              file=str(path), key=key, line=key_line)
        value = _value(value_node, path)
        if not isinstance(value, (str, int, float)):
            raise ConfigError("must be a string", file=str(path), key=key, line=key_line)
        raw[key] = _substitute(str(value), thresholds, path, key_line, key)
        key_lines[key] = key_line
    for required in ("alert", "expr", "severity", "summary", "description"):
        if required not in raw:
            raise ConfigError(f"missing '{required}'", file=str(path), line=line)
    name = raw["alert"]
    if not _NAME.match(name) or not name.startswith(PREFIXES):
        raise ConfigError(f"alert name '{name}' must be CamelCase and start with one of "
                          f"{', '.join(PREFIXES)}", file=str(path), key="alert", line=line)
    if raw["severity"] not in SEVERITIES:
        raise ConfigError(f"severity must be one of {', '.join(SEVERITIES)}", file=str(path),
                          key="severity", line=key_lines["severity"])
    action = raw.get("action")
    if action is not None and action not in ACTIONS:
        raise ConfigError(f"unknown action '{action}' (known: {', '.join(ACTIONS)})",
                          file=str(path), key="action", line=key_lines["action"])
    durations = {}
    for key in ("for", "keep_firing_for"):
        try:
            durations[key] = promql.parse_duration(raw.get(key, "0s"))
        except ValueError as exc:
            raise ConfigError(f"bad duration: {exc}", file=str(path), key=key,
                              line=key_lines.get(key, line)) from None
    expr_text = " ".join(raw["expr"].split())
    try:
        parsed = promql.parse(expr_text)
    except promql.PromQLError as exc:
        raise ConfigError(f"alert {name}: bad expression: {exc} (at: "
                          f"{expr_text[exc.pos or 0:][:40]!r})", file=str(path), key="expr",
                          line=key_lines["expr"]) from None
    if isinstance(parsed.root, promql.Number):
        raise ConfigError(f"alert {name}: the expression must select series, not a number",
                          file=str(path), key="expr", line=key_lines["expr"])
    unknown = sorted(parsed.metrics - set(METRICS) - PROMETHEUS_METRICS)
    if unknown:
        raise ConfigError(f"alert {name}: metric(s) not in the metrics contract "
                          f"(trainwatch/contract/metrics.py): {', '.join(unknown)}",
                          file=str(path), key="expr", line=key_lines["expr"])
    for key in ("summary", "description"):
        raw[key] = " ".join(raw[key].split())
        for m in _TEMPLATE_ACTION.finditer(raw[key]):
            if not any(p.match(m.group(1)) for p in _ALLOWED_ACTIONS):
                raise ConfigError(f"alert {name}: template {m.group(0)!r} is not supported "
                                  "(use {{ $labels.NAME }} or {{ printf \"%.Nf\" $value }})",
                                  file=str(path), key=key, line=key_lines[key])
    if name not in runbooks:
        raise ConfigError(f"alert {name} has no runbook (runbooks/{name}.md)", file=str(path),
                          key="alert", line=line)
    return Rule(name=name, group=group, expr=expr_text, ast=parsed.root,
                metrics=parsed.metrics, for_seconds=durations["for"],
                keep_firing_seconds=durations["keep_firing_for"], severity=raw["severity"],
                action=action, summary=raw["summary"], description=raw["description"],
                file=str(path), line=line)


def available_runbooks() -> set[str]:
    """Alert names with a runbook shipped in the installed package."""
    folder = resources.files("trainwatch.runbooks")
    return {p.name[:-3] for p in folder.iterdir() if p.name.endswith(".md")}


def render_template(template: str, labels: dict[str, str], value: float) -> str:
    """Expand the template subset exactly as Prometheus' Go templates would."""
    def repl(m: re.Match) -> str:
        body = m.group(1)
        label = _ALLOWED_ACTIONS[0].match(body)
        if label:
            return labels.get(label.group(1), "")
        printf = _ALLOWED_ACTIONS[1].match(body)
        assert printf, "load_rules lets no other template action through"
        digits = int(printf.group(1))
        if value != value:
            return "NaN"
        if value in (float("inf"), float("-inf")):
            return "+Inf" if value > 0 else "-Inf"
        return f"{value:.{digits}f}"
    return _TEMPLATE_ACTION.sub(repl, template)
