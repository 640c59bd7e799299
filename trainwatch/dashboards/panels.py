"""Building blocks for the dashboards: a ``Board`` that lays panels out and writes queries.

Every query is written through ``Board.sel`` (or ``rate``/``increase``), which looks the
metric up in the metrics contract and filters it by the dashboard's variables that the
metric actually carries (GPU series have no ``run``, so ``$run`` never filters them).
A name missing from the contract fails here, when the dashboard is built.
"""

from __future__ import annotations

from typing import Any, Iterable

from trainwatch.alerts.rules import DEFAULT_RUNBOOK_BASE
from trainwatch.contract.metrics import METRICS

SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE_WINDOW = "[$__rate_interval]"
GRID_WIDTH = 24
# Colours for state values, in the order states are listed (Grafana's named palette).
PALETTE = ("green", "blue", "orange", "purple", "yellow", "red", "dark-red", "text",
           "light-blue", "light-green", "dark-purple", "super-light-orange")

VARIABLES = ("run", "node", "rank")


def match(label: str, value: str, op: str = "=") -> str:
    """A label matcher, ``label="value"`` (or with ``!=``, ``=~``, ``!~``)."""
    return f'{label}{op}"{value}"'


def _selector(metric: str, variables: Iterable[str], matchers: Iterable[str] = ()) -> str:
    """``metric{var=~"$var", ..., matchers}`` for the variables the metric is labelled by."""
    parts = [match(v, f"${v}", "=~") for v in variables if v in METRICS[metric].labels]
    parts += matchers
    return f"{metric}{{{', '.join(parts)}}}" if parts else metric


def target(expr: str, legend: str = "", *, table: bool = False) -> dict[str, Any]:
    """One Prometheus query of a panel (refId is assigned by the panel); ``table``: the
    current values only, one row per series."""
    t = {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend or "__auto",
         "range": not table, "instant": table}
    if table:
        t["format"] = "table"
    return t


def states(values: Iterable[str], colors: dict[str, str] | None = None) -> list[dict]:
    """Value mappings 0..n-1 -> state names, for the numbers ``Board.enum`` produces."""
    colors = colors or {}
    return [{"type": "value", "options": {
        str(i): {"text": v, "color": colors.get(v, PALETTE[i % len(PALETTE)]), "index": i}}}
        for i, v in enumerate(values)]


def flags(off: str, on: str, on_color: str = "red") -> list[dict]:
    """Value mappings for a 0/1 gauge."""
    return [{"type": "value", "options": {"0": {"text": off, "color": "green", "index": 0},
                                          "1": {"text": on, "color": on_color, "index": 1}}}]


def _thresholds(limit: float | None, base: str = "green") -> dict[str, Any]:
    steps: list[dict[str, Any]] = [{"color": base, "value": None}]
    if limit is not None:
        steps.append({"color": "red", "value": limit})
    return {"mode": "absolute", "steps": steps}


class Board:
    """One dashboard: its variables, its panels placed left to right in rows of 24."""

    def __init__(self, name: str, title: str, description: str, variables: tuple[str, ...],
                 runbook_base: str = DEFAULT_RUNBOOK_BASE, single_run: bool = False):
        unknown = set(variables) - set(VARIABLES)
        if unknown:
            raise ValueError(f"unknown template variable(s): {sorted(unknown)}")
        self.name, self.title, self.description = name, title, description
        self.variables = variables
        self.runbook_base = runbook_base
        self.single_run = single_run
        self.panels: list[dict[str, Any]] = []
        self.annotations: list[dict[str, Any]] = []
        self._x = self._y = self._row_height = 0

    @property
    def uid(self) -> str:
        """Stable: re-uploading or re-provisioning overwrites the same dashboard."""
        return f"trainwatch-{self.name}"

    # ------------------------------------------------------------------ queries
    def sel(self, metric: str, *matchers: str) -> str:
        """The metric filtered by this dashboard's variables, plus ``matchers``."""
        if metric not in METRICS:
            raise ValueError(f"dashboard {self.name}: {metric} is not in the metrics contract")
        return _selector(metric, self.variables, matchers)

    def rate(self, metric: str, *matchers: str) -> str:
        return f"rate({self.sel(metric, *matchers)}{RATE_WINDOW})"

    def increase(self, metric: str, *matchers: str) -> str:
        return f"increase({self.sel(metric, *matchers)}{RATE_WINDOW})"

    def enum(self, metric: str, label: str, values: Iterable[str], by: str) -> str:
        """One number per series for a 1-of-n state gauge: the index of the state that is 1.

        ``trainwatch_rank_phase`` & co. are one series per state; a state timeline wants
        one series per rank whose value names the state (see ``states``).
        """
        alternatives = " or ".join(f"({self.sel(metric, match(label, v))} == 1) * {i}"
                                   for i, v in enumerate(values))
        return f"max by ({by}) ({alternatives})"

    # ------------------------------------------------------------------ layout
    def row(self, title: str) -> None:
        self._newline()
        self.panels.append({"type": "row", "title": title, "collapsed": False, "panels": [],
                            "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": self._y}})
        self._y += 1

    def _newline(self) -> None:
        if self._x:
            self._x, self._y, self._row_height = 0, self._y + self._row_height, 0

    def _place(self, panel: dict[str, Any], w: int, h: int, alerts: tuple[str, ...],
               description: str) -> None:
        if self._x + w > GRID_WIDTH:
            self._newline()
        panel["gridPos"] = {"h": h, "w": w, "x": self._x, "y": self._y}
        self._x += w
        self._row_height = max(self._row_height, h)
        for i, t in enumerate(panel["targets"]):
            t["refId"] = chr(ord("A") + i)
        panel["datasource"] = DATASOURCE
        if alerts:
            description += " Alerts: " + ", ".join(alerts) + " (runbook links above)."
            panel["links"] = [{"title": f"Runbook: {a}", "url": f"{self.runbook_base}{a}.md",
                               "targetBlank": True} for a in alerts]
        panel["description"] = description
        self.panels.append(panel)

    # ------------------------------------------------------------------ panels
    def timeseries(self, title: str, *targets: dict, unit: str = "short",
                   description: str = "", alerts: tuple[str, ...] = (), stack: bool = False,
                   limit: float | None = None, min_: float | None = None,
                   max_: float | None = None, w: int = 8, h: int = 8) -> None:
        """A line chart; ``limit`` draws the alert threshold as a red line."""
        custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 30 if stack else 0,
                  "showPoints": "never", "spanNulls": False,
                  "stacking": {"mode": "normal" if stack else "none", "group": "A"},
                  "thresholdsStyle": {"mode": "line" if limit is not None else "off"}}
        defaults: dict[str, Any] = {"unit": unit, "custom": custom,
                                    "color": {"mode": "palette-classic"},
                                    "thresholds": _thresholds(limit)}
        if min_ is not None:
            defaults["min"] = min_
        if max_ is not None:
            defaults["max"] = max_
        self._place({"type": "timeseries", "title": title, "targets": list(targets),
                     "fieldConfig": {"defaults": defaults, "overrides": []},
                     "options": {"legend": {"displayMode": "list", "placement": "bottom",
                                            "showLegend": True, "calcs": []},
                                 "tooltip": {"mode": "multi", "sort": "desc"}}},
                    w, h, alerts, description)

    def stat(self, title: str, *targets: dict, unit: str = "short", description: str = "",
             alerts: tuple[str, ...] = (), limit: float | None = None,
             mappings: list[dict] | None = None, w: int = 3, h: int = 4) -> None:
        """A single number (the last value); turns red at ``limit``."""
        self._place({"type": "stat", "title": title, "targets": list(targets),
                     "fieldConfig": {"defaults": {"unit": unit, "mappings": mappings or [],
                                                  "color": {"mode": "thresholds"},
                                                  "thresholds": _thresholds(limit)},
                                     "overrides": []},
                     "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "",
                                                   "values": False},
                                 "colorMode": "value", "graphMode": "area",
                                 "justifyMode": "auto", "orientation": "auto",
                                 "textMode": "auto"}},
                    w, h, alerts, description)

    def table(self, title: str, *targets: dict, description: str = "",
              alerts: tuple[str, ...] = (), hide: tuple[str, ...] = (),
              links: dict[str, str] | None = None, w: int = 12, h: int = 8) -> None:
        """Instant query results as rows, one column per label; ``hide`` drops columns,
        ``links`` turns a column into a link (URL template per column name)."""
        excluded = {name: True for name in ("Time", "Value", "__name__", "local_rank") + hide}
        overrides = [{"matcher": {"id": "byName", "options": column},
                      "properties": [{"id": "links", "value": [
                          {"title": "Runbook", "url": url, "targetBlank": True}]}]}
                     for column, url in sorted((links or {}).items())]
        self._place({"type": "table", "title": title, "targets": list(targets),
                     "fieldConfig": {"defaults": {}, "overrides": overrides},
                     "options": {"showHeader": True, "cellHeight": "sm"},
                     "transformations": [
                         {"id": "merge", "options": {}},
                         {"id": "organize", "options": {"excludeByName": excluded}}]},
                    w, h, alerts, description)

    def state_timeline(self, title: str, *targets: dict, mappings: list[dict],
                       description: str = "", alerts: tuple[str, ...] = (), w: int = 12,
                       h: int = 8) -> None:
        """One row per series, coloured by the state its value maps to."""
        self._place({"type": "state-timeline", "title": title, "targets": list(targets),
                     "fieldConfig": {"defaults": {"mappings": mappings,
                                                  "color": {"mode": "thresholds"},
                                                  "thresholds": _thresholds(None, "text"),
                                                  "custom": {"fillOpacity": 80,
                                                             "lineWidth": 0}},
                                     "overrides": []},
                     "options": {"mergeValues": True, "showValue": "auto",
                                 "alignValue": "left", "rowHeight": 0.9,
                                 "legend": {"displayMode": "list", "placement": "bottom",
                                            "showLegend": False},
                                 "tooltip": {"mode": "single", "sort": "none"}}},
                    w, h, alerts, description)

    def annotate(self, name: str, expr: str, title: str, text: str = "",
                 color: str = "red") -> None:
        """Marks on every time axis while ``expr`` returns a series."""
        self.annotations.append({"name": name, "datasource": DATASOURCE, "enable": True,
                                 "expr": expr, "iconColor": color, "titleFormat": title,
                                 "textFormat": text, "tagKeys": "", "useValueForTime": False,
                                 "step": "60s"})

    # ------------------------------------------------------------------ output
    def _variable(self, name: str) -> dict[str, Any]:
        """A label_values() variable, narrowed by the variables before it.

        Nodes come from the ranks of the chosen run when ``run`` comes first, else from
        every agent (``trainwatch_collector_up``), so idle nodes are listed too.
        """
        before = self.variables[:self.variables.index(name)]
        metric = ("trainwatch_collector_up" if name == "node" and "run" not in before
                  else "trainwatch_rank_up")
        query = f"label_values({_selector(metric, before)}, {name})"
        multi = not (name == "run" and self.single_run)
        variable = {"name": name, "label": name, "type": "query", "datasource": DATASOURCE,
                    "query": {"qryType": 1, "query": query,
                              "refId": "PrometheusVariableQueryEditor-VariableQuery"},
                    "definition": query, "refresh": 2, "sort": 3 if name == "rank" else 1,
                    "multi": multi, "includeAll": multi, "current": {}, "options": [],
                    "hide": 0, "regex": ""}
        if multi:  # "All" by default, matched as a regex
            variable["allValue"] = ".*"
            variable["current"] = {"selected": True, "text": ["All"], "value": ["$__all"]}
        return variable

    def to_json(self) -> dict[str, Any]:
        for i, panel in enumerate(self.panels, start=1):
            panel["id"] = i
        datasource = {"name": "datasource", "label": "Data source", "type": "datasource",
                      "query": "prometheus", "current": {}, "options": [], "hide": 0,
                      "refresh": 1, "regex": "", "includeAll": False, "multi": False}
        builtin = {"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                   "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                   "name": "Annotations & Alerts", "type": "dashboard"}
        return {
            "uid": self.uid, "title": self.title, "description": self.description,
            "tags": ["trainwatch"], "schemaVersion": SCHEMA_VERSION, "version": 1,
            "editable": True, "graphTooltip": 1, "timezone": "browser", "refresh": "30s",
            "time": {"from": "now-1h", "to": "now"}, "fiscalYearStartMonth": 0,
            "liveNow": False, "weekStart": "",
            "templating": {"list": [datasource] + [self._variable(v) for v in self.variables]},
            "annotations": {"list": [builtin] + self.annotations},
            "links": [{"title": "trainwatch", "type": "dashboards", "tags": ["trainwatch"],
                       "asDropdown": True, "includeVars": True, "keepTime": True,
                       "icon": "external link", "targetBlank": False, "tooltip": "",
                       "url": ""}],
            "panels": self.panels,
        }
