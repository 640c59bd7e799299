"""``trainwatch dashboards``: export, list, check and upload the Grafana dashboards."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from trainwatch.contract.env import GRAFANA_TOKEN_ENV
from trainwatch.errors import EXIT_PROBLEM, ConfigError, missing_extra, output_error

_paths_arg = click.argument("paths", nargs=-1, type=click.Path(exists=True))
_runbook_opt = click.option("--runbook-base", default=None,
                            help="URL prefix of the runbook links (default: the one the alert "
                                 "rules use).")


def _load(paths: tuple[str, ...], runbook_base: str | None = None) -> list[dict[str, Any]]:
    """Dashboards from JSON files (or folders of them), else built from the source."""
    from trainwatch.alerts.rules import DEFAULT_RUNBOOK_BASE
    from trainwatch.dashboards.check import malformed
    from trainwatch.dashboards.generate import build_all
    if not paths:
        return build_all(runbook_base or DEFAULT_RUNBOOK_BASE)
    files = [f for p in map(Path, paths)
             for f in (sorted(p.glob("*.json")) if p.is_dir() else [p])]
    if not files:
        raise ConfigError(f"no *.json files in {', '.join(paths)}")
    out = []
    for f in files:
        try:
            doc = json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ConfigError(f"not a dashboard JSON file: {exc}", file=str(f)) from None
        if not isinstance(doc, dict) or not isinstance(doc.get("panels"), list):
            raise ConfigError("not a Grafana dashboard (no 'panels' list)", file=str(f))
        bad = malformed(doc)
        if bad is not None:
            key, _, what = bad.partition(": ")
            raise ConfigError(f"not a usable Grafana dashboard: {what}", file=str(f), key=key)
        out.append(doc)
    return out


@click.group("dashboards")
def dashboards() -> None:
    """Grafana dashboards generated from one source (dashboards/*.py)."""


@dashboards.command("export")
@click.option("--out", "out_dir", default="trainwatch-dashboards", show_default=True,
              type=click.Path(file_okay=False), help="Folder to write the JSON files to.")
@_runbook_opt
@click.option("--thresholds", "thresholds_file", type=click.Path(dir_okay=False),
              help="Alert threshold overrides, as for `trainwatch alerts export` (thresholds "
                   "lines, the agents' scrape job `agent_job`).")
def export(out_dir: str, runbook_base: str | None, thresholds_file: str | None) -> None:
    """Write every dashboard as JSON (for Grafana's file provisioning or manual import)."""
    from trainwatch.alerts.rules import DEFAULT_RUNBOOK_BASE
    from trainwatch.dashboards.generate import export as write
    try:
        paths = write(out_dir, runbook_base or DEFAULT_RUNBOOK_BASE, thresholds_file)
    except OSError as exc:
        raise output_error(exc, out_dir, key="--out") from None
    for path in paths:
        click.echo(str(path))


@dashboards.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def list_(as_json: bool) -> None:
    """List the dashboards: uid, title, panels and queries."""
    from trainwatch.dashboards.check import panels, queries
    from trainwatch.dashboards.generate import file_name
    rows = [{"uid": d["uid"], "title": d["title"], "file": file_name(d),
             "panels": sum(p["type"] != "row" for p in panels(d)),
             "queries": len(list(queries(d)))} for d in _load(())]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        click.echo(f"{r['uid']:32s} {r['panels']:3d} panels  {r['queries']:3d} queries  "
                   f"{r['title']}")


@dashboards.command("check")
@_paths_arg
@click.option("--prometheus", "prometheus_url", metavar="URL",
              help="Also run every query through this Prometheus (/api/v1/query), with "
                   "variables set to All and $__rate_interval to 1m.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def check(paths: tuple[str, ...], prometheus_url: str | None, as_json: bool) -> None:
    """Check dashboards: metrics and labels in the contract, well-formed queries, datasource,
    layout (exit 1 names dashboard, panel and problem).

    PATHS are dashboard JSON files or folders of them; default: the shipped dashboards.
    """
    from trainwatch.dashboards.check import check_dashboard, check_with_prometheus, queries
    report: list[dict[str, Any]] = []
    for d in _load(paths):
        problems = check_dashboard(d)
        if prometheus_url and not problems:
            problems += check_with_prometheus(d, prometheus_url)[0]
        report.append({"uid": d.get("uid"), "title": d.get("title"),
                       "queries": len(list(queries(d))),
                       "problems": [{"panel": p.panel, "problem": p.problem}
                                    for p in problems]})
    failed = sum(len(r["problems"]) for r in report)
    if as_json:
        click.echo(json.dumps({"dashboards": report, "problems": failed}, indent=2))
    else:
        for r in report:
            for p in r["problems"]:
                click.echo(f"{r['uid']}: {p['panel']}: {p['problem']}")
            if not r["problems"]:
                click.echo(f"OK {r['uid']} ({r['queries']} queries)")
        click.echo(f"{failed} problem(s) in {len(report)} dashboard(s)")
    if failed:
        sys.exit(EXIT_PROBLEM)


@dashboards.command("upload")
@_paths_arg
@click.option("--url", required=True, help="Grafana base URL, e.g. https://grafana.example.com/")
@click.option("--folder", default="trainwatch", show_default=True,
              help="Grafana folder (created if missing).")
@click.option("--token-file", type=click.Path(dir_okay=False),
              help=f"File holding a Grafana service account token (default: "
                   f"${GRAFANA_TOKEN_ENV}).")
@click.option("--dry-run", is_flag=True, help="Show what would be uploaded; contact nothing.")
@_runbook_opt
def upload(paths: tuple[str, ...], url: str, folder: str, token_file: str | None,
           dry_run: bool, runbook_base: str | None) -> None:
    """Upload the dashboards to Grafana, overwriting earlier uploads by uid.

    PATHS are dashboard JSON files or folders of them; default: the shipped dashboards.
    Exit 2 on bad usage or a refused token, 1 when Grafana cannot be reached or fails.
    """
    try:
        from trainwatch.dashboards.upload import Uploader, check_url, read_token
    except ImportError as exc:
        raise missing_extra(exc, "grafana", key="upload") from None
    docs = _load(paths, runbook_base)
    check_url(url)
    if dry_run:
        click.echo(f"would upload to {url} folder '{folder}' (overwrite by uid):")
        for d in docs:
            click.echo(f"  {d.get('uid')}  {d.get('title')}")
        return
    uploader = Uploader(url, read_token(token_file))
    for done in uploader.upload(docs, folder):
        click.echo(f"uploaded {done.uid} (version {done.version}) {done.url}")
