"""A rank that dies of an error nothing caught says so in its status: bad input, so that
nobody restarts it, and where it was, for whoever diagnoses it.

torchrun turns any failed rank into its own exit code 1, so the job's exit code cannot
carry "bad input" (2): a misspelt ``Checkpoints.from_env`` key was restarted until the
restart guard paged. ``Telemetry.start`` installs this hook: a ConfigError nothing caught
closes the rank's telemetry as failed with ``failure: {"kind": "bad_input", "message"}``
(the supervisor reads it); any other error publishes the rank's pending steps and status
at once (they wait for the next heartbeat otherwise, which the process does not live to
see). Then the hook before it prints the traceback as always.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from trainwatch.contract.states import BAD_INPUT, FAILED
from trainwatch.errors import ConfigError

if TYPE_CHECKING:
    from trainwatch.trainer.telemetry import Telemetry


def install(tel: "Telemetry") -> None:
    previous = sys.excepthook

    def hook(exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if isinstance(exc, ConfigError) and tel.running:
                tel.close(FAILED, failure={"kind": BAD_INPUT, "message": str(exc)[:2000]})
            elif tel.running:
                tel.publish_now()
        finally:  # the traceback is printed whatever the status write met (a full disk)
            previous(exc_type, exc, tb)

    sys.excepthook = hook
