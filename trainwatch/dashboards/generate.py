"""All dashboards from the one source, rendered as stable JSON (the files in generated/)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainwatch.alerts.rules import DEFAULT_RUNBOOK_BASE, load_thresholds
from trainwatch.dashboards import node, ranks, self_monitoring, training

GENERATED_DIR = Path(__file__).with_name("generated")
BUILDERS = (training.build, ranks.build, node.build, self_monitoring.build)


def build_all(runbook_base: str = DEFAULT_RUNBOOK_BASE,
              thresholds_file: str | Path | None = None) -> list[dict[str, Any]]:
    """Every board, drawing thresholds and selectors (the scrape job) from the alerts' own
    thresholds file, with a user's overrides on top, so boards and rules agree."""
    limits = load_thresholds(thresholds_file)
    return [build(runbook_base, limits) for build in BUILDERS]


def file_name(dashboard: dict[str, Any]) -> str:
    return f"{dashboard['uid']}.json"


def render(dashboard: dict[str, Any]) -> str:
    """Sorted keys and a final newline, so regenerating is byte-identical."""
    return json.dumps(dashboard, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def export(out_dir: str | Path, runbook_base: str = DEFAULT_RUNBOOK_BASE,
           thresholds_file: str | Path | None = None) -> list[Path]:
    dashboards = build_all(runbook_base, thresholds_file)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for dashboard in dashboards:
        path = out / file_name(dashboard)
        path.write_text(render(dashboard))
        written.append(path)
    return written
