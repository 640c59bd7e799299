"""Stop signals of the long-running commands (``trainwatch run``, ``alerts receive``,
``drill``). SIGTERM (systemctl stop, a pod's end, Slurm) stops them as Ctrl-C does; once
a stop is under way, more of them (a second Ctrl-C, a SIGTERM sent to every process of a
job step) are ignored to its end: a KeyboardInterrupt in the middle of the shutdown would
cut it short, leaving the run's end unrecorded. SIG_IGN, not a Python handler: the
interpreter resets those to the default as it exits, and a late signal would then kill
the process after its work was done, with -15 for an exit code."""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def stop_on_sigterm() -> None:
    """SIGTERM raises KeyboardInterrupt, like Ctrl-C (``trainwatch.cli.main`` makes sure
    SIGINT does)."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def stopping() -> None:
    """A stop is under way: further stop signals cannot interrupt it."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
