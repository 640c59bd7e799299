"""The embedded engine's clock: scrape the agents, add local gauges, evaluate, repeat."""

from __future__ import annotations

import logging
import threading
import time

from trainwatch.alerts.actions import ActionRequest, ActionRunner
from trainwatch.alerts.engine import Alert, Engine
from trainwatch.alerts.evaluate import labels_key
from trainwatch.alerts.notify import rfc3339
from trainwatch.alerts.scrape import Scraper
from trainwatch.contract.metrics import RUN_LABEL

log = logging.getLogger(__name__)


class EngineLoop:
    """Runs ``Engine.evaluate`` every ``interval`` seconds in a thread."""

    def __init__(self, engine: Engine, scraper: Scraper | None, interval: float):
        self.engine = engine
        self.scraper = scraper
        self.interval = interval
        # Gauges the controller itself owns (e.g. the restart guard), refreshed every tick.
        self.local: dict[tuple, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ticks = 0

    def set_local(self, labels: dict[str, str], value: float) -> None:
        self.local[labels_key(labels)] = value

    def tick(self, t: float | None = None) -> None:
        t = time.time() if t is None else t
        if self.scraper is not None:
            self.scraper.scrape_all(t)
        for key, value in self.local.items():
            self.engine.history.add(key, t, value)
        self.engine.evaluate(t)
        self.ticks += 1

    def start(self) -> "EngineLoop":
        self._thread = threading.Thread(target=self._run, name="tw-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.time()
            try:
                self.tick(started)
            except Exception:  # noqa: BLE001 - the engine keeps evaluating
                log.exception("engine tick failed")
            self._stop.wait(max(0.0, self.interval - (time.time() - started)))


def connect_actions(engine: Engine, runner: ActionRunner, loop: EngineLoop) -> None:
    """Firing alerts with an action go to the runner; a tripped guard becomes a metric."""
    def on_firing(alert: Alert) -> None:
        req = ActionRequest(alert.name, alert.rule.action, dict(alert.labels),
                            alert.fingerprint, rfc3339(alert.active_at), "engine",
                            dict(alert.annotations))
        # Acting (evidence, stopping the job) takes seconds; evaluation must not wait.
        threading.Thread(target=runner.handle, args=(req,), name="tw-action",
                         daemon=True).start()

    def on_guard(job: str, tripped: bool) -> None:
        loop.set_local({"__name__": "trainwatch_action_restart_guard_tripped", RUN_LABEL: job},
                       1.0 if tripped else 0.0)

    engine.on_firing = on_firing
    runner.on_guard = on_guard
    loop.set_local({"__name__": "trainwatch_action_restart_guard_tripped", RUN_LABEL: runner.job},
                   1.0 if runner.guard_tripped else 0.0)
