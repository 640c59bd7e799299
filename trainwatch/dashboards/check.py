"""Checks that a dashboard's queries can work: known metrics and labels, well-formed PromQL.

Dashboards use the PromQL subset the alert rules use (``trainwatch.alerts.promql``), so
one parser finds every metric a rule or a panel reads.  Grafana's template variables are
replaced by placeholders before parsing; a multi-value variable must sit in a regex
matcher (``=~``), or picking two values would break the query.
"""

from __future__ import annotations

import dataclasses
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Iterator

from trainwatch.alerts import promql
from trainwatch.alerts.rules import PROMETHEUS_METRICS
from trainwatch.dashboards.panels import DATASOURCE
from trainwatch.errors import ConfigError
from trainwatch.contract.metrics import METRICS

# Series Prometheus makes itself: scrape health and its alerts.
PROMETHEUS_SERIES = set(PROMETHEUS_METRICS) | {"ALERTS"}
BUILTIN_DURATIONS = {"__rate_interval", "__interval", "__range"}
_VARIABLE = re.compile(r"\$(\w+)|\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]")
_LABEL_VALUES = re.compile(r"^\s*label_values\((?:(.*),)?\s*(\w+)\s*\)\s*$", re.S)
_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")
_PAIRS = {")": "(", "]": "[", "}": "{"}


@dataclass(frozen=True)
class Problem:
    dashboard: str
    panel: str
    problem: str

    def __str__(self) -> str:
        return f"{self.dashboard}: {self.panel}: {self.problem}"


@dataclass(frozen=True)
class Query:
    """One query of a dashboard: a panel target, a variable or an annotation."""

    dashboard: str
    panel: str
    expr: str
    legend: str = ""
    label_values: str | None = None  # label_values(selector, LABEL): the label
    ref: str = ""  # the target's refId


def malformed(dashboard: dict[str, Any]) -> str | None:
    """The first key whose value the checks cannot use (``panels[2].title: ...``), or None.

    Grafana's own JSON, from any file: a title that is a list or a target that is a
    string is bad input to name, not a traceback.
    """
    def texts(obj: dict[str, Any], keys: tuple[str, ...], where: str) -> str | None:
        bad = next((k for k in keys if not isinstance(obj.get(k), (str, type(None)))), None)
        return None if bad is None else f"{where}{bad}: not a string"

    def objects(obj: dict[str, Any], key: str, where: str) -> tuple[str | None, list]:
        value = obj.get(key)
        if value is None:
            return None, []
        if not isinstance(value, list):
            return f"{where}{key}: not a list", []
        bad = next((i for i, v in enumerate(value) if not isinstance(v, dict)), None)
        return (None, value) if bad is None else (f"{where}{key}[{bad}]: not an object", [])

    def panel(p: dict[str, Any], where: str, nested: bool) -> str | None:
        found = texts(p, ("title", "type"), where)
        grid = p.get("gridPos")
        if grid is not None and not (isinstance(grid, dict) and all(
                isinstance(v, (int, float)) and not isinstance(v, bool)
                for k, v in grid.items() if k in ("x", "y", "w", "h"))):
            found = found or f"{where}gridPos: not an object of numbers x, y, w, h"
        bad, targets = objects(p, "targets", where)
        found = found or bad
        for i, t in enumerate(targets):
            found = found or texts(t, ("expr", "legendFormat", "refId"), f"{where}targets[{i}].")
        if not nested:
            bad, inner = objects(p, "panels", where)
            found = found or bad
            for i, q in enumerate(inner):
                found = found or panel(q, f"{where}panels[{i}].", True)
        return found

    found = texts(dashboard, ("uid", "title"), "")
    bad, top = objects(dashboard, "panels", "")
    found = found or bad
    for i, p in enumerate(top):
        found = found or panel(p, f"panels[{i}].", False)
    for section, keys in (("templating", ("name", "type")), ("annotations", ("name", "expr"))):
        value = dashboard.get(section)
        if value is None:
            continue
        if not isinstance(value, dict):
            return found or f"{section}: not an object"
        bad, items = objects(value, "list", f"{section}.")
        found = found or bad
        for i, item in enumerate(items):
            where = f"{section}.list[{i}]."
            found = found or texts(item, keys, where)
            query = item.get("query")
            if section == "templating" and isinstance(query, dict):
                found = found or texts(query, ("query",), f"{where}query.")
            elif section == "templating" and query is not None and not isinstance(query, str):
                found = found or f"{where}query: not a string or an object"
    return found


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside (collapsed) rows too."""
    for panel in dashboard.get("panels") or []:
        yield panel
        yield from panel.get("panels") or []


def queries(dashboard: dict[str, Any]) -> Iterator[Query]:
    name = dashboard.get("uid") or dashboard.get("title") or "?"
    for panel in panels(dashboard):
        for t in panel.get("targets") or []:
            if t.get("expr"):
                yield Query(name, f"panel '{panel.get('title')}'", t["expr"],
                            t.get("legendFormat") or "", ref=t.get("refId", ""))
    for var in (dashboard.get("templating") or {}).get("list") or []:
        if var.get("type") != "query":
            continue
        text = var.get("query")
        text = (text.get("query") if isinstance(text, dict) else text) or ""
        m = _LABEL_VALUES.match(text)
        where = f"variable '{var.get('name')}'"
        if m:
            yield Query(name, where, m.group(1) or "", label_values=m.group(2))
        else:
            yield Query(name, where, text)
    for ann in (dashboard.get("annotations") or {}).get("list") or []:
        if ann.get("expr"):
            yield Query(name, f"annotation '{ann.get('name')}'", ann["expr"])


def variables(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v.get("name"): v for v in (dashboard.get("templating") or {}).get("list") or []}


def substitute(expr: str, values: dict[str, str], duration: str = "1m") -> str:
    """Grafana's variables replaced: built-in intervals by ``duration``, others by ``values``."""
    def repl(m: re.Match) -> str:
        name = next(g for g in m.groups() if g)
        if name in BUILTIN_DURATIONS:
            return duration
        return values.get(name, m.group(0))
    return _VARIABLE.sub(repl, expr)


def _balanced(expr: str) -> str | None:
    stack: list[tuple[str, int]] = []
    in_string = None
    for i, ch in enumerate(expr):
        if in_string:
            if ch == in_string and expr[i - 1] != "\\":
                in_string = None
        elif ch in "\"'":
            in_string = ch
        elif ch in "([{":
            stack.append((ch, i))
        elif ch in _PAIRS:
            if not stack or stack[-1][0] != _PAIRS[ch]:
                return f"unbalanced {ch!r} at character {i}"
            stack.pop()
    if in_string:
        return "unterminated string"
    if stack:
        return f"unclosed {stack[-1][0]!r} at character {stack[-1][1]}"
    return None


def _nodes(node: Any) -> Iterator[Any]:
    yield node
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            for child in value if isinstance(value, tuple) else (value,):
                if dataclasses.is_dataclass(child):
                    yield from _nodes(child)


def _labels(node: Any, problems: list[str]) -> set[str] | None:
    """Labels the result of ``node`` can carry (None: unknown), noting by()/on() labels
    that no series underneath has."""
    if isinstance(node, promql.Number):
        return set()
    if isinstance(node, promql.Selector):
        spec = METRICS.get(node.name)
        return set(spec.labels) if spec else None
    if isinstance(node, promql.Call):
        return _labels(node.args[0], problems) if node.args else set()
    if isinstance(node, promql.Aggregate):
        inner = _labels(node.expr, problems)
        if inner is not None:
            problems += [f"by ({label}): no series here has that label"
                         for label in node.by if label not in inner]
        return set(node.by)
    lhs, rhs = _labels(node.lhs, problems), _labels(node.rhs, problems)
    for side in (lhs, rhs):
        if node.on and side is not None and side:
            problems += [f"on ({label}): no series here has that label"
                         for label in node.on if label not in side]
    return None if lhs is None or rhs is None else lhs | rhs


def check_query(q: Query, dashboard_vars: dict[str, dict[str, Any]]) -> list[Problem]:
    def problem(text: str) -> Problem:
        return Problem(q.dashboard, q.panel, text)

    found = []
    for m in _VARIABLE.finditer(q.expr):
        name = next(g for g in m.groups() if g)
        if name not in dashboard_vars and name not in BUILTIN_DURATIONS:
            found.append(problem(f"${name} is not a variable of this dashboard"))
    if found:
        return found
    # A placeholder per variable, a valid regex, so matchers can be traced back to it.
    placeholders = {name: f"__var_{name}__" for name in dashboard_vars}
    text = substitute(q.expr, placeholders)
    if q.label_values is not None and not text.strip():
        return []  # label_values(label): every series
    unbalanced = _balanced(text)
    if unbalanced:
        return [problem(f"{unbalanced} in {q.expr!r}")]
    try:
        parsed = promql.parse(text)
    except promql.PromQLError as exc:
        return [problem(f"bad query: {exc} (at: {text[exc.pos or 0:][:40]!r}) in {q.expr!r}")]
    for name in sorted(parsed.metrics - set(METRICS) - PROMETHEUS_SERIES):
        found.append(problem(f"{name} is not in the metrics contract "
                             "(trainwatch/contract/metrics.py)"))
    for node in _nodes(parsed.root):
        if not isinstance(node, promql.Selector):
            continue
        spec = METRICS.get(node.name)
        for label, op, value in node.matchers:
            if spec and label not in spec.labels:
                found.append(problem(f"{node.name} has no label '{label}' "
                                     f"(labels: {', '.join(spec.labels)})"))
            for name, placeholder in placeholders.items():
                multi = dashboard_vars[name].get("multi") or dashboard_vars[name].get("includeAll")
                if placeholder in value and multi and op not in ("=~", "!~"):
                    found.append(problem(f"${name} can hold several values: match it with =~, "
                                         f"not {op}"))
    label_problems: list[str] = []
    result_labels = _labels(parsed.root, label_problems)
    found += [problem(p) for p in label_problems]
    wanted = [q.label_values] if q.label_values else _LEGEND_LABEL.findall(q.legend)
    if result_labels is not None:
        what = "label_values() label" if q.label_values else "legend"
        found += [problem(f"{what} uses '{label}', which the query's result does not carry")
                  for label in wanted if label not in result_labels]
    return found


def check_dashboard(dashboard: dict[str, Any]) -> list[Problem]:
    """Everything that can be checked without a Prometheus."""
    name = dashboard.get("uid") or dashboard.get("title") or "?"
    found = []
    uid = dashboard.get("uid") or ""
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", uid):
        found.append(Problem(name, "dashboard", f"uid {uid!r} must be 1-40 letters, digits, "
                                                "'-' or '_'"))
    dashboard_vars = variables(dashboard)
    ds = dashboard_vars.get("datasource")
    if not ds or ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        found.append(Problem(name, "dashboard", "needs a 'datasource' variable of type "
                                                "datasource (prometheus)"))
    titles: set[object] = set()  # as the JSON has them
    for panel in panels(dashboard):
        if panel.get("type") == "row":
            continue
        where = f"panel '{panel.get('title')}'"
        if panel.get("title") in titles:
            found.append(Problem(name, where, "another panel has the same title"))
        titles.add(panel.get("title"))
        sources = [panel.get("datasource")] + [t.get("datasource") for t in
                                               panel.get("targets") or [] if "datasource" in t]
        if any(s != DATASOURCE for s in sources):
            found.append(Problem(name, where, f"datasource must be {DATASOURCE} (the "
                                              "$datasource variable)"))
        if not panel.get("targets"):
            found.append(Problem(name, where, "has no query"))
    found += overlaps(dashboard)
    for q in queries(dashboard):
        found += check_query(q, dashboard_vars)
    return found


def overlaps(dashboard: dict[str, Any]) -> list[Problem]:
    name = dashboard.get("uid") or "?"
    placed: list[tuple[object, tuple[Any, Any, Any, Any]]] = []  # (title, x y w h)
    found = []
    for panel in dashboard.get("panels") or []:  # gridPos of top-level panels share a grid
        g = panel.get("gridPos") or {}
        box = (g.get("x", 0), g.get("y", 0), g.get("w", 0), g.get("h", 0))
        if box[0] + box[2] > 24:
            found.append(Problem(name, f"panel '{panel.get('title')}'", "wider than the grid"))
        for other, obox in placed:
            if (box[0] < obox[0] + obox[2] and obox[0] < box[0] + box[2]
                    and box[1] < obox[1] + obox[3] and obox[1] < box[1] + box[3]):
                found.append(Problem(name, f"panel '{panel.get('title')}'",
                                     f"overlaps panel '{other}'"))
        placed.append((panel.get("title"), box))
    return found


def prometheus_query(url: str, expr: str, timeout: float = 10.0) -> dict[str, Any]:
    """``GET /api/v1/query``; Prometheus answers 400/422 with a JSON error body."""
    full = f"{url.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    try:
        with urllib.request.urlopen(full, timeout=timeout) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as exc:
        try:
            return json.load(exc)
        except ValueError:
            return {"status": "error", "error": f"HTTP {exc.code}"}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot query Prometheus at {url}: {exc}", key="--prometheus") \
            from None


def check_with_prometheus(dashboard: dict[str, Any], url: str,
                          values: dict[str, str] | None = None,
                          duration: str = "1m") -> tuple[list[Problem], dict[Query, int]]:
    """Run every query through a real Prometheus; returns problems and series counts.

    Variables take ``values`` (default ``.*``, i.e. "All").
    """
    values = {name: ".*" for name in variables(dashboard)} | (values or {})
    found, counts = [], {}
    for q in queries(dashboard):
        if q.label_values is not None and not q.expr.strip():
            continue
        doc = prometheus_query(url, substitute(q.expr, values, duration))
        if doc.get("status") != "success":
            found.append(Problem(q.dashboard, q.panel, f"Prometheus: {doc.get('errorType', '')} "
                                                       f"{doc.get('error', doc)}".strip()))
            continue
        counts[q] = len(doc.get("data", {}).get("result") or [])
    return found, counts
