"""A rank that dies of an error nothing caught says so in its status: bad input, so that
nobody restarts it, and which error, for whoever diagnoses it.

torchrun turns any failed rank into its own exit code 1, so the job's exit code cannot
carry "bad input" (2): a misspelt ``Checkpoints.from_env`` key was restarted until the
restart guard paged. ``Telemetry.start`` installs this hook: a ConfigError nothing caught
closes the rank's telemetry as failed with ``failure: {"kind": "bad_input", "message"}``
(the supervisor reads it); any other exception closes it as failed with ``failure:
{"kind": "error", "message"}`` and journals ``failed`` with the error, as the reference
trainer does (else the dead rank read as ``running`` in phase ``step``, and diagnose could
not tell it from the peers torchrun stopped). Closing publishes the pending steps at once
(they wait for the next heartbeat otherwise, which the process does not live to see); a
KeyboardInterrupt only publishes them (an interruption, not a failure). Then the hook
before it prints the traceback as always.
"""

from __future__ import annotations

import sys
from typing import Any, Protocol

from trainwatch.contract.states import BAD_INPUT, ERROR, FAILED
from trainwatch.errors import ConfigError


class Closable(Protocol):
    """What the hook needs of the rank's telemetry."""

    @property
    def running(self) -> bool: ...

    def close(self, state: str = ..., *, failure: dict[str, Any] | None = None) -> None: ...

    def event(self, event: str, **fields: Any) -> None: ...

    def publish_now(self) -> None: ...


def install(tel: Closable) -> None:
    previous = sys.excepthook

    def hook(exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if isinstance(exc, ConfigError) and tel.running:
                tel.close(FAILED, failure={"kind": BAD_INPUT, "message": str(exc)[:2000]})
            elif isinstance(exc, Exception) and tel.running:
                error = f"{exc_type.__name__}: {exc}"[:2000]
                tel.event("failed", error=error)
                tel.close(FAILED, failure={"kind": ERROR, "message": error})
            elif tel.running:
                tel.publish_now()
        finally:  # the traceback is printed whatever the status write met (a full disk)
            previous(exc_type, exc, tb)

    sys.excepthook = hook
