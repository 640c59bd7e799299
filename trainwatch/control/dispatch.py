"""Firing alerts with an action go to the action runner; asked again until final."""

from __future__ import annotations

import logging
import threading
import time

from trainwatch.alerts.engine import Alert, Engine
from trainwatch.alerts.loop import EngineLoop
from trainwatch.alerts.notify import rfc3339
from trainwatch.contract.metrics import RESTART_GUARD_METRIC, RUN_LABEL
from trainwatch.control.actions import ActionRequest, ActionRunner
from trainwatch.control.controller import ControllerClosed

log = logging.getLogger(__name__)


def connect_actions(engine: Engine, runner: ActionRunner, loop: EngineLoop) -> None:
    """Firing alerts with an action go to the runner; a tripped guard becomes a metric.

    The engine announces an alert once, when it starts firing. An answer that is not final
    is asked again while the alert keeps firing: a restart the rate limit held back when
    its window ends, a stall the controller's own evidence did not confirm every
    ``policy.recheck_seconds``, as Alertmanager's
    ``repeat_interval`` re-delivers to the webhook receiver: a stall that was refuted while
    the job still moved and then became real is acted on without a new alert.
    """
    lock = threading.Lock()
    in_flight: set[str] = set()  # fingerprints being handled now
    reask_at: dict[str, float] = {}  # fingerprint -> monotonic time to ask again

    def handle(alert: Alert, req: ActionRequest) -> None:
        final, wait = False, runner.policy.recheck_seconds
        try:
            outcome = runner.handle(req)
            final = outcome.final
            if outcome.retry_after is not None:
                wait = outcome.retry_after
        except ControllerClosed:
            log.info("%s: not acted on, the controller is shutting down", alert.name)
        finally:  # an action that raised is asked again too
            with lock:
                in_flight.discard(alert.fingerprint)
                if final:
                    reask_at.pop(alert.fingerprint, None)
                else:
                    reask_at[alert.fingerprint] = time.monotonic() + wait

    def on_firing(alert: Alert) -> None:
        with lock:
            if alert.fingerprint in in_flight:
                return
            in_flight.add(alert.fingerprint)
        action = alert.rule.action
        assert action, "only the alerts of rules with an action are handed over"
        req = ActionRequest(alert.name, action, dict(alert.labels),
                            alert.fingerprint, rfc3339(alert.active_at), "engine",
                            dict(alert.annotations))
        # Acting (evidence, stopping the job) takes seconds; evaluation must not wait.
        threading.Thread(target=handle, args=(alert, req), name="tw-action",
                         daemon=True).start()

    def reask(_t: float) -> None:
        firing = {a.fingerprint: a for a in engine.firing() if a.rule.action}
        now = time.monotonic()
        with lock:
            for fp in [fp for fp in reask_at if fp not in firing]:
                del reask_at[fp]  # resolved: nothing left to ask
            due = [firing[fp] for fp, at in reask_at.items() if at <= now and fp not in in_flight]
        for alert in due:
            on_firing(alert)

    def on_guard(job: str, tripped: bool) -> None:
        loop.set_local({"__name__": RESTART_GUARD_METRIC, RUN_LABEL: job},
                       1.0 if tripped else 0.0)

    engine.on_firing = on_firing
    loop.after_tick.append(reask)
    runner.on_guard = on_guard
    loop.set_local({"__name__": RESTART_GUARD_METRIC, RUN_LABEL: runner.job},
                   1.0 if runner.guard_tripped else 0.0)
