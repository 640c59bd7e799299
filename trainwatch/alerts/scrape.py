"""Feeding the embedded engine: scrape the agents' /metrics like Prometheus would.

Each scrape adds every sample (parsed with prometheus_client's parser) to the
history at the scrape time with the target's ``job`` (the rules' ``agent_job`` selector,
``trainwatch-agent`` by default) and ``instance`` labels, writes ``up{job=...,instance=...}``
(1 or 0) exactly as Prometheus does, and marks the target's vanished series stale.
"""

from __future__ import annotations

import logging
import time
import urllib.request
from urllib.parse import urlparse

from prometheus_client.parser import text_string_to_metric_families

from trainwatch.alerts.evaluate import History, Labels, labels_key
from trainwatch.alerts.rules import AGENT_JOB, load_thresholds

log = logging.getLogger(__name__)


class Scraper:
    def __init__(self, history: History, targets: list[str], timeout: float = 5.0,
                 job: str | None = None):
        self.history = history
        # The scrape job the rules select (EngineLoop sets the ruleset's); default: the package's.
        self.job: str = load_thresholds()[AGENT_JOB] if job is None else job
        self.targets = [t if "://" in t else f"http://{t}" for t in targets]
        self.timeout = timeout
        self._seen: dict[str, set[Labels]] = {}
        self.failures: dict[str, str] = {}

    def scrape_all(self, t: float | None = None) -> None:
        t = time.time() if t is None else t
        for target in self.targets:
            self.scrape(target, t)

    def scrape(self, target: str, t: float) -> bool:
        url = target.rstrip("/") + ("" if target.rstrip("/").endswith("/metrics") else "/metrics")
        instance = urlparse(url).netloc
        # Default label handling: the target's labels are added to every series (trainwatch
        # exports neither, so nothing is renamed to exported_*).
        target_labels = {"job": self.job, "instance": instance}
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as resp:
                text = resp.read().decode("utf-8", "replace")
            keys = set()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name.endswith("_created"):
                        continue  # prometheus_client's creation timestamps are not series
                    key = labels_key({"__name__": sample.name, **sample.labels, **target_labels})
                    self.history.add(key, t, float(sample.value))
                    keys.add(key)
            ok = True
            self.failures.pop(target, None)
        except (OSError, ValueError) as exc:
            keys, ok = set(), False
            if self.failures.get(target) != str(exc):
                log.warning("scrape of %s failed: %s", url, exc)
            self.failures[target] = str(exc)
        # Series this target exported last time but not now are stale (as in Prometheus).
        for key in self._seen.get(target, set()) - keys:
            self.history.add(key, t, None)
        self._seen[target] = keys
        self.history.add(labels_key({"__name__": "up", **target_labels}), t,
                         1.0 if ok else 0.0)
        return ok
