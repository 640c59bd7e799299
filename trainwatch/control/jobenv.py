"""The environment the controller hands to the job it starts: its own, minus secrets.

The controller's environment holds trainwatch's tokens (the receiver's bearer token, the
Grafana token) and whatever else its operator exported; the training job, its logs, its
core dumps and everything it spawns need none of them. Dropped: trainwatch's own tokens
and every name ending in _TOKEN, _KEY, _SECRET, _PASSWORD or _CREDENTIALS (any case).
A secret the job does need (a tracker's API key) is passed on by naming it in
``TRAINWATCH_PASS_ENV`` (comma-separated); trainwatch's own tokens never are.
"""

from __future__ import annotations

import os
import re
from typing import Mapping

from trainwatch.contract.env import GRAFANA_TOKEN_ENV, RECEIVER_TOKEN_ENV

PASS_ENV = "TRAINWATCH_PASS_ENV"
SECRET_NAME = re.compile(r"(_TOKEN|_KEY|_SECRET|_PASSWORD|_CREDENTIALS)$", re.IGNORECASE)
NEVER_PASSED = frozenset({RECEIVER_TOKEN_ENV, GRAFANA_TOKEN_ENV})


def is_secret(name: str) -> bool:
    return name in NEVER_PASSED or bool(SECRET_NAME.search(name))


def job_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) without the secrets the job must not get."""
    environ = os.environ if environ is None else environ
    passed = {n.strip() for n in environ.get(PASS_ENV, "").split(",") if n.strip()}
    return {name: value for name, value in environ.items()
            if not is_secret(name) or (name in passed and name not in NEVER_PASSED)}
