"""A rank that dies on bad input says so in its status, so that nobody restarts it.

torchrun turns any failed rank into its own exit code 1, so the job's exit code cannot
carry "bad input" (2): a misspelt ``Checkpoints.from_env`` key was restarted until the
restart guard paged. ``Telemetry.start`` installs this hook: a ConfigError nothing caught
closes the rank's telemetry as failed with ``failure: {"kind": "bad_input", "message"}``
(the supervisor reads it), then the hook before it prints the traceback as always.
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
        finally:  # the traceback is printed whatever the status write met (a full disk)
            previous(exc_type, exc, tb)

    sys.excepthook = hook
