"""``trainwatch report --html FILE``: the report as one self-contained page of charts.

Built with plotly (interactive: zoom into a restart, hover a point) with plotly.js
inlined once, so the page opens anywhere, offline, and fetches nothing. The numbers
come from the same report dictionary as the text and JSON views; the time series are
read by ``report.series``, downsampled while reading, so a long run stays a small page.
"""

from __future__ import annotations

import html
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from trainwatch.errors import output_error
from trainwatch.report.render import _CATEGORY_TEXT, duration, percent
from trainwatch.report.goodput import CATEGORIES
from trainwatch.report.series import Series

# One colour per time category, the same in every chart.
COLOURS = {"productive": "#2e7d32", "data_wait": "#81c784", "recomputed": "#ef6c00",
           "restart_downtime": "#c62828", "initial_startup": "#90a4ae",
           "checkpoint": "#1565c0", "evaluation": "#6a1b9a", "stalled": "#ad1457",
           "shutdown": "#b0bec5", "other": "#e0e0e0"}
_CONFIG = {"displaylogo": False, "responsive": True}
# Nothing from the network, even if a future plotly version tried: inline code and data only.
_CSP = ("default-src 'none'; script-src 'unsafe-inline' 'unsafe-eval'; "
        "style-src 'unsafe-inline'; img-src data:; font-src data:")


def _when(t: float) -> str:
    """Wall time as an ISO string plotly reads as a date axis (local time)."""
    return datetime.fromtimestamp(t).isoformat(timespec="milliseconds")


def time_chart(data: dict[str, Any]) -> go.Figure:
    wall = data["time"]["wall_seconds"] or 0
    cats = [c for c in CATEGORIES if data["categories"].get(c)]
    fig = go.Figure()
    for c in cats:
        seconds = data["categories"][c]
        fig.add_trace(go.Bar(
            y=["wall time"], x=[seconds], orientation="h", name=_CATEGORY_TEXT[c],
            marker_color=COLOURS[c],
            hovertemplate=f"{_CATEGORY_TEXT[c]}: {duration(seconds)} "
                          f"({percent(seconds / wall if wall else None)})<extra></extra>"))
    fig.update_layout(barmode="stack", title="Where the time went", height=260,
                      legend_traceorder="normal",
                      xaxis_title="seconds", legend={"orientation": "h", "y": -0.35},
                      margin={"l": 80, "r": 20, "t": 50, "b": 20})
    return fig


def progress_chart(data: dict[str, Any], series: Series) -> go.Figure:
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("loss", "step time (s)"))
    points = _broken_at(series.loss, [a["started_at"] for a in data["attempts"][1:]])
    times = [_when(p[0]) if p[0] is not None else None for p in points]
    steps = [p[1] for p in points]
    per = f" (mean of {series.stride} steps)" if series.stride > 1 else ""
    fig.add_trace(go.Scatter(x=times, y=[p[2] for p in points], mode="lines",
                             name="loss" + per, customdata=steps, line={"color": "#1565c0"},
                             hovertemplate="step %{customdata}: loss %{y:.4f}<extra></extra>"),
                  row=1, col=1)
    fig.add_trace(go.Scatter(x=times, y=[p[3] for p in points], mode="lines",
                             name="step time" + per, customdata=steps, line={"color": "#6a1b9a"},
                             hovertemplate="step %{customdata}: %{y:.3f} s<extra></extra>"),
                  row=2, col=1)
    for attempt in data["attempts"][1:]:  # every attempt after the first is a restart
        fig.add_vline(x=_when(attempt["started_at"]), line={"color": "#ef6c00", "dash": "dash"})
    restarts = data["attempts"][1:]
    if restarts:
        fig.add_trace(go.Scatter(
            x=[_when(a["started_at"]) for a in restarts], y=[0] * len(restarts),
            mode="markers", marker={"symbol": "triangle-up", "color": "#ef6c00", "size": 11},
            name="restart", text=[f"attempt {a['index']} resumed from step {a['resumed_from']}"
                                  for a in restarts], hovertemplate="%{text}<extra></extra>"),
            row=2, col=1)
    incidents = [i for i in data["incidents"] if i["time"] is not None]
    if incidents:
        fig.add_trace(go.Scatter(
            x=[_when(i["time"]) for i in incidents], y=[0] * len(incidents), mode="markers",
            marker={"symbol": "x", "color": "#c62828", "size": 12}, name="incident",
            text=[f"{i['cause']} (lost {i['steps_lost']} steps, {duration(i['total_seconds'])})"
                  for i in incidents], hovertemplate="%{text}<extra></extra>"), row=2, col=1)
    alerts = [e for e in series.events if e["event"] == "alert_firing"]
    if alerts:
        fig.add_trace(go.Scatter(
            x=[_when(e["time"]) for e in alerts], y=[0] * len(alerts), mode="markers",
            marker={"symbol": "diamond", "color": "#ad1457", "size": 10}, name="alert firing",
            text=[str(e.get("alert")) for e in alerts], hovertemplate="%{text}<extra></extra>"),
            row=1, col=1)
    fig.update_xaxes(range=_span(data))
    fig.update_layout(title="Loss and step time over wall time (dashed: restarts)", height=520,
                      legend={"orientation": "h", "y": -0.12},
                      margin={"l": 60, "r": 20, "t": 70, "b": 40})
    return fig


def _broken_at(points: list[list[float | None]], restarts: list[float]) -> list[list]:
    """The points with a gap (a row of None) where a restart lies between two of them, so
    a line never joins the last step before a failure to the first one after it."""
    out: list[list] = []
    pending = sorted(restarts)
    last: float | None = None
    for p in points:
        t = p[0]
        if t is not None:
            if last is not None and pending and last <= pending[0] <= t:
                out.append([None] * len(p))
            while pending and pending[0] <= t:
                pending.pop(0)
            last = t
        out.append(p)
    return out


def heatmap_chart(series: Series) -> go.Figure:
    fig = go.Figure(go.Heatmap(
        z=series.heatmap, x=series.heatmap_steps, y=[f"rank {r}" for r in series.heatmap_ranks],
        colorscale="Viridis", colorbar={"title": "s"},
        hovertemplate="%{y}, steps from %{x}: %{z:.3f} s<extra></extra>"))
    fig.update_layout(title="Step time per rank (mean per step bucket; a straggler is a "
                            "bright row)", height=max(260, 60 + 28 * len(series.heatmap_ranks)),
                      xaxis_title="step", margin={"l": 80, "r": 20, "t": 50, "b": 40})
    return fig


def checkpoint_chart(data: dict[str, Any], series: Series) -> go.Figure:
    saves = [e for e in series.events if e["event"] == "checkpoint_saved"]
    failed = [e for e in series.events if e["event"] == "checkpoint_failed"]
    fig = go.Figure()
    fig.add_trace(go.Scatter(
        x=[_when(e["time"]) for e in saves], y=[e.get("blocking_seconds") or 0 for e in saves],
        mode="markers", name="loop blocked (s)", marker={"color": "#1565c0", "size": 10},
        customdata=[e.get("step") for e in saves],
        hovertemplate="step %{customdata}: loop blocked %{y:.3f} s<extra></extra>"))
    fig.add_trace(go.Scatter(
        x=[_when(e["time"]) for e in saves], y=[e.get("write_seconds") or 0 for e in saves],
        mode="markers", name="written in (s)", customdata=[e.get("step") for e in saves],
        marker={"color": "#6a1b9a", "symbol": "diamond", "size": 9},
        hovertemplate="step %{customdata}: written in %{y:.3f} s<extra></extra>"))
    if failed:
        fig.add_trace(go.Scatter(x=[_when(e["time"]) for e in failed], y=[0] * len(failed),
                                 mode="markers", name="save failed",
                                 marker={"symbol": "x", "color": "#c62828", "size": 12}))
    fig.update_layout(title=f"Checkpoint saves ({len(saves)}" +
                      (f", {len(failed)} failed)" if failed else ")"), height=300,
                      yaxis_title="seconds", legend={"orientation": "h", "y": -0.25},
                      xaxis_range=_span(data), margin={"l": 60, "r": 20, "t": 50, "b": 40})
    return fig


def _span(data: dict[str, Any]) -> list[str] | None:
    """The run's wall-time span, so time charts line up with each other."""
    t = data["time"]
    return [_when(t["start"]), _when(t["end"])] if t["start"] and t["end"] else None


def page(data: dict[str, Any], series: Series) -> str:
    charts = [("time", time_chart(data)), ("progress", progress_chart(data, series)),
              ("ranks", heatmap_chart(series)), ("checkpoints", checkpoint_chart(data, series))]
    steps = data["steps"]
    facts = [("state", data["state"]), ("wall time", duration(data["time"]["wall_seconds"])),
             ("goodput", percent(data["goodput_ratio"])),
             ("steps", f"{steps['unique']}" + (f" of {steps['target']}" if steps["target"] else "")),
             ("attempts", str(len(data["attempts"]))), ("incidents", str(len(data["incidents"]))),
             ("world size", str(data["world_size"] or "?"))]
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in facts)
    incidents = "".join(
        f"<tr><td>{i['attempt'] if i['attempt'] is not None else 'none'}</td><td>{html.escape(str(i['cause']))}</td>"
        f"<td>{i['steps_lost']}</td><td>{duration(i['total_seconds'])}</td></tr>"
        for i in data["incidents"]) or "<tr><td colspan=4>none: every attempt ran to its end</td></tr>"
    body = "\n".join(
        f'<section class="chart" id="chart-{name}">'
        + fig.to_html(full_html=False, include_plotlyjs=False, config=_CONFIG,
                      div_id=f"plot-{name}") + "</section>" for name, fig in charts)
    title = f"trainwatch report · {data['job']}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{_CSP}">
<title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1200px; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1em; }}
th, td {{ border: 1px solid #ddd; padding: 0.25em 0.7em; text-align: left; }}
section.chart {{ margin: 1em 0; }}
</style>
<script>{get_plotlyjs()}</script>
</head><body>
<h1>{html.escape(title)}</h1>
<p>{html.escape(str(data['run_dir']))}</p>
<table>{rows}</table>
<h2>Incidents</h2>
<table><tr><th>attempt</th><th>cause</th><th>steps lost</th><th>cost in time</th></tr>{incidents}</table>
{body}
<script type="application/json" id="report-data">{_json_for_script(data)}</script>
</body></html>
"""


def _json_for_script(data: dict[str, Any]) -> str:
    """The report dictionary, embedded for whoever wants the numbers (``</`` escaped)."""
    return json.dumps(data).replace("</", "<\\/")


def write_html(path: Path, data: dict[str, Any], series: Series) -> None:
    try:
        Path(path).write_text(page(data, series), encoding="utf-8")
    except OSError as exc:
        raise output_error(exc, path, key="--html") from None
