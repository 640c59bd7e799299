"""The alert vocabulary: severities, automatic actions, and the catalog of alerts.

The rules source (alerts/rules.yaml) is the one home of each alert; the catalog here
reads its names and severities as data, so the agent can label its journal counters
without importing the alert engine.
"""

from __future__ import annotations

from importlib import resources

import yaml

SEVERITIES = ("critical", "warning", "info")
ACTIONS = ("stall_restart", "restart", "rollback_skip", "straggler", "checkpoint_now",
           "replica_rollback")
# An alert that acts before the page it stands in for: silencing the page (the name people
# know to silence) holds the early action too.
ACTS_BEFORE = {"TrainingStallSuspected": "TrainingStalled"}
# Alerts about the supervisor itself: its embedded engine cannot send them (frozen or dead,
# it sends nothing), so the agent `trainwatch run` starts evaluates and sends them instead
# (control/supervisor_pager.py) and the supervisor's engine leaves them out.
PAGED_BY_AGENT = ("TrainwatchSupervisorDown",)

# Where the packaged rules source lives.
RULES_PACKAGE = "trainwatch.alerts"
RULES_RESOURCE = "rules.yaml"
THRESHOLDS_RESOURCE = "thresholds.yaml"


def alert_catalog() -> list[tuple[str, str]]:
    """(alert name, severity) of every rule in the packaged rules source.

    Only names and severities are read; ``trainwatch alerts check`` validates the file.
    """
    text = resources.files(RULES_PACKAGE).joinpath(RULES_RESOURCE).read_text()
    doc = yaml.safe_load(text) or {}
    catalog = []
    for group in doc.get("groups") or []:
        for rule in (group or {}).get("rules") or []:
            if isinstance(rule, dict) and isinstance(rule.get("alert"), str):
                catalog.append((rule["alert"], str(rule.get("severity"))))
    return sorted(set(catalog))
