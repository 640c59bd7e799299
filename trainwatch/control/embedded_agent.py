"""The agent ``trainwatch run`` starts beside the job: its port, its process, its first answer."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request

import click

from trainwatch.contract.layout import AGENT_LOG, LOGS_DIR
from trainwatch.contract.ports import LOOPBACK
from trainwatch.errors import ConfigError
from trainwatch.process.proctree import spawn
from trainwatch.rundir.run_dir import RunDir


def free_port(port: int = 0) -> int:
    """``port`` on loopback if it is free (exit 2 if not), else any free one."""
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError as exc:
            raise ConfigError(f"cannot listen on {LOOPBACK}:{port}: {exc.strerror or exc}",
                              key="--agent-port") from None
        return s.getsockname()[1]


def start_agent(run: RunDir, port: int, config: str | None, *,
                rules: tuple[str | None, str | None] = (None, None),
                webhooks: tuple[str, ...] = (), alertmanager: str | None = None
                ) -> subprocess.Popen:
    """The agent, with the pager of the alerts about the supervisor (``rules``: the rules
    and thresholds files; ``webhooks``, ``alertmanager``: where the supervisor sends its
    alerts), which a frozen or dead supervisor cannot send (control/supervisor_pager.py)."""
    cmd = [sys.executable, "-m", "trainwatch.control.supervisor_pager", "--run-dir",
           str(run.root), "--listen", f"{LOOPBACK}:{port}"]
    if config:
        cmd += ["--config", str(config)]
    for option, path in zip(("--rules", "--thresholds"), rules):
        if path:
            cmd += [option, str(path)]
    for url in webhooks:
        cmd += ["--webhook", url]
    if alertmanager:
        cmd += ["--alertmanager", alertmanager]
    with open(run.logs_dir / AGENT_LOG, "ab") as log:
        return spawn(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                     start_new_session=True)


def wait_for_agent(proc: subprocess.Popen, target: str, timeout: float = 60.0) -> bool:
    """Wait until the agent answers /healthz, so the engine's first scrapes are not
    failures; False (and a warning) if it died or is still not up after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://{target}/healthz", timeout=1):
                return True
        except OSError:
            time.sleep(0.2)
    click.echo(f"trainwatch agent on {target} is not up (see {LOGS_DIR}/{AGENT_LOG}): alerts that "
               "need its metrics are blind until it is", err=True)
    return False
