"""Replay ``promtool test rules`` scenarios through the embedded engine.

The same test file drives both engines: promtool checks the exported rules, this
module feeds the identical input series to ``Engine`` at the identical evaluation
times and reports which alerts fire when.  ``trainwatch alerts test FILE`` uses it,
and so do the equivalence tests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainwatch.alerts.engine import Alert, Engine
from trainwatch.alerts.evaluate import STALE, History, labels_key
from trainwatch.alerts.promql import parse_duration
from trainwatch.alerts.rules import RuleSet
from trainwatch.config.yamlfile import load_yaml_mapping
from trainwatch.contract.env import REGENERATE_ENV
from trainwatch.errors import ConfigError

MISSING = object()
_SERIES_RE = re.compile(r'^\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*(?:\{(.*)\})?\s*$')
_LABEL_RE = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_NUM = r'\d+(?:\.\d+)?(?:[eE][-+]?\d+)?'
_EXPAND_RE = re.compile(rf'^(-?{_NUM}|_)(?:([+-])({_NUM}))?x(\d+)$')


def parse_series(text: str) -> dict[str, str]:
    m = _SERIES_RE.match(text)
    if not m:
        raise ConfigError(f"cannot parse series {text!r}")
    labels = {"__name__": m.group(1)}
    body = m.group(2) or ""
    pos = 0
    while pos < len(body.strip()):
        lm = _LABEL_RE.match(body, pos)
        if not lm:
            raise ConfigError(f"cannot parse labels of series {text!r}")
        labels[lm.group(1)] = lm.group(2)
        pos = lm.end()
    return labels


def expand_values(text: str) -> list[Any]:
    """promtool's expanding notation: ``1+2x3`` -> 1 3 5 7, ``_x2`` -> _ _, ``stale``."""
    out: list[Any] = []
    for token in text.split():
        if token == "_":
            out.append(MISSING)
        elif token == "stale":
            out.append(STALE)
        elif "x" in token:
            m = _EXPAND_RE.match(token)
            if not m:
                raise ConfigError(f"cannot expand series values {token!r}")
            start, sign, step, n = m.groups()
            if start == "_":
                out.extend([MISSING] * int(n))
                continue
            a, b = float(start), float(step or 0) * (-1 if sign == "-" else 1)
            out.extend(a + i * b for i in range(int(n) + 1))
        else:
            out.append(float(token))
    return out


@dataclass
class Check:
    eval_time: float
    alertname: str
    expected: list[dict[str, Any]]  # each {"exp_labels": ..., "exp_annotations": ...}


def _alerts_at(engine: Engine, name: str) -> list[Alert]:
    return [a for a in engine.firing() if a.name == name]


def replay_group(ruleset: RuleSet, group: dict[str, Any], evaluation_interval: float,
                 *, runbook_base: str | None = None) -> dict[tuple[float, str], list[Alert]]:
    """Run one test group; returns the firing alerts at each (eval_time, alertname) checked."""
    interval = parse_duration(group.get("interval", "1m")) if group.get("interval") else \
        evaluation_interval
    history = History(retention_seconds=1e12)
    engine = Engine(ruleset, history, runbook_base=runbook_base)
    series = [(labels_key(parse_series(s["series"])), expand_values(str(s.get("values", ""))))
              for s in group.get("input_series", [])]
    checks = [Check(parse_duration(c["eval_time"]), c["alertname"], c.get("exp_alerts") or [])
              for c in group.get("alert_rule_test", [])]
    end = max((c.eval_time for c in checks), default=0.0)
    results: dict[tuple[float, str], list[Alert]] = {}
    t = 0.0
    index = 0
    while t <= end + 1e-9:
        while index * interval <= t + 1e-9:
            for key, values in series:
                if index < len(values) and values[index] is not MISSING:
                    history.add(key, index * interval, values[index])
            index += 1
        engine.evaluate(t)
        for check in checks:
            if t <= check.eval_time < t + evaluation_interval - 1e-9:
                results[(check.eval_time, check.alertname)] = [
                    _copy(a) for a in _alerts_at(engine, check.alertname)]
        t += evaluation_interval
    return results


def _copy(alert: Alert) -> Alert:
    return Alert(alert.rule, dict(alert.labels), dict(alert.annotations), alert.value,
                 alert.active_at, alert.state, alert.fired_at)


def replay_file(ruleset: RuleSet, path: str | Path, *, runbook_base: str | None = None
                ) -> list[tuple[str, Check, list[Alert], bool]]:
    """Replay every test of a promtool test file; returns (test, check, got, ok) rows.

    A check passes when the firing alerts' label sets (and, where the file gives them,
    annotations) equal the expected ones.
    """
    doc = load_yaml_mapping(path)
    try:
        check_test_file(doc)
        return _replay(ruleset, doc, runbook_base)
    except ConfigError as exc:
        if exc.file is not None:
            raise
        raise ConfigError(exc.problem, file=str(path), key=exc.key) from None


def check_test_file(doc: dict[str, Any]) -> None:
    """The shape of a promtool test file, so a typo names its key instead of a traceback."""
    def duration(value: Any, key: str) -> None:
        try:
            parse_duration(str(value))
        except ValueError as exc:
            raise ConfigError(str(exc), key=key) from None

    duration(doc.get("evaluation_interval", "1m"), "evaluation_interval")
    tests = doc.get("tests")
    if not isinstance(tests, list):
        raise ConfigError("must be a list of test groups (promtool's `tests:`)", key="tests")
    for i, group in enumerate(tests):
        if not isinstance(group, dict):
            raise ConfigError("must be a mapping", key=f"tests[{i}]")
        if "interval" in group:
            duration(group["interval"], f"tests[{i}].interval")
        for part, needs in (("input_series", ("series",)),
                            ("alert_rule_test", ("eval_time", "alertname"))):
            entries = group.get(part) or []
            if not isinstance(entries, list):
                raise ConfigError("must be a list", key=f"tests[{i}].{part}")
            for j, entry in enumerate(entries):
                key = f"tests[{i}].{part}[{j}]"
                missing = [n for n in needs if not isinstance(entry, dict) or n not in entry]
                if missing:
                    raise ConfigError(f"needs {' and '.join(missing)}", key=key)
                if part == "alert_rule_test":
                    duration(entry["eval_time"], f"{key}.eval_time")
                    expected = entry.get("exp_alerts") or []
                    if not (isinstance(expected, list)
                            and all(isinstance(e, dict) for e in expected)):
                        raise ConfigError("must be a list of mappings (exp_labels, "
                                          "exp_annotations)", key=f"{key}.exp_alerts")


def _replay(ruleset: RuleSet, doc: dict[str, Any], runbook_base: str | None
            ) -> list[tuple[str, Check, list[Alert], bool]]:
    interval = parse_duration(doc.get("evaluation_interval", "1m"))
    rows = []
    for i, group in enumerate(doc.get("tests") or []):
        got = replay_group(ruleset, group, interval, runbook_base=runbook_base)
        for c in group.get("alert_rule_test", []):
            check = Check(parse_duration(c["eval_time"]), c["alertname"],
                          c.get("exp_alerts") or [])
            alerts = got.get((check.eval_time, check.alertname), [])
            rows.append((group.get("name", f"test {i + 1}"), check, alerts,
                         _matches(check, alerts)))
    return rows


def _matches(check: Check, alerts: list[Alert]) -> bool:
    def key(labels: dict[str, str]) -> tuple:
        return tuple(sorted((str(k), str(v)) for k, v in labels.items()))
    want = sorted(key({**e.get("exp_labels", {}), "alertname": check.alertname})
                  for e in check.expected)
    have = sorted(key(a.labels) for a in alerts)
    if want != have:
        return False
    for e in check.expected:
        if "exp_annotations" not in e:
            continue
        labels = key({**e.get("exp_labels", {}), "alertname": check.alertname})
        alert = next(a for a in alerts if key(a.labels) == labels)
        if {str(k): str(v) for k, v in e["exp_annotations"].items()} != alert.annotations:
            return False
    return True


def promtool_test_file(ruleset: RuleSet, scenarios: str | Path, rule_file: str,
                       runbook_base: str) -> str:
    """The scenarios as a complete ``promtool test rules`` file.

    The hand-written scenarios pin the labels and moments; the annotations each expected
    alert must carry are rendered by the embedded engine at that moment, so promtool
    also proves that both engines render the templates identically.
    """
    import yaml

    doc = load_yaml_mapping(scenarios)
    interval = parse_duration(doc.get("evaluation_interval", "1m"))
    for group in doc.get("tests") or []:
        got = replay_group(ruleset, group, interval, runbook_base=runbook_base)
        for c in group.get("alert_rule_test", []):
            alerts = {tuple(sorted(a.labels.items())): a
                      for a in got.get((parse_duration(c["eval_time"]), c["alertname"]), [])}
            for exp in c.get("exp_alerts") or []:
                labels = {str(k): str(v) for k, v in exp["exp_labels"].items()}
                alert = alerts.get(tuple(sorted({**labels, "alertname": c["alertname"]}.items())))
                if alert is None:
                    raise ConfigError(f"the embedded engine does not fire {c['alertname']} "
                                      f"{labels} at {c['eval_time']}", file=str(scenarios))
                exp["exp_annotations"] = dict(alert.annotations)
    doc = {"rule_files": [rule_file], **doc}
    header = (f"# Generated from {Path(scenarios).name} by tests/alerts/test_alert_rules.py "
              f"({REGENERATE_ENV}=1 rewrites it). Do not edit.\n")
    return header + yaml.safe_dump(doc, sort_keys=False, width=100)
