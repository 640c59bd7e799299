"""Optional Prometheus queries: firing alerts and rank ages for this job."""

from __future__ import annotations

from typing import Any

from trainwatch.contract.metrics import RUN_LABEL
from trainwatch.diagnose.http_json import get_json
from trainwatch.diagnose.model import Evidence

QUERIES = {
    "firing_alerts": 'ALERTS{{alertstate="firing"{run}}}',
    "progress_age": "trainwatch_rank_progress_age_seconds{{{run_only}}}",
    "heartbeat_age": "trainwatch_rank_heartbeat_age_seconds{{{run_only}}}",
}


def gather(ev: Evidence, url: str | None, timeout: float) -> None:
    if not url:
        return
    run_id = (ev.run or {}).get("job")
    matcher = f'{RUN_LABEL}="{run_id}"' if run_id else ""
    results: dict[str, Any] = {"url": url}
    for name, template in QUERIES.items():
        query = template.format(run=f",{matcher}" if matcher else "", run_only=matcher)
        try:
            doc = get_json(url.rstrip("/") + "/api/v1/query", timeout, {"query": query})
        except (OSError, ValueError) as exc:
            ev.cannot_see(f"Prometheus {url}: {exc}")
            results["error"] = str(exc)
            break
        if not isinstance(doc, dict) or doc.get("status") != "success":
            ev.cannot_see(f"Prometheus {url}: query {query!r} failed: "
                          f"{(doc or {}).get('error') if isinstance(doc, dict) else doc}")
            continue
        results[name] = [{"labels": r.get("metric", {}), "value": (r.get("value") or [None, None])[1]}
                         for r in doc.get("data", {}).get("result", [])]
    ev.prometheus = results


def firing_alerts(ev: Evidence) -> list[str]:
    return sorted({r["labels"].get("alertname", "?")
                   for r in (ev.prometheus or {}).get("firing_alerts", [])})
