"""``trainwatch runbook NAME``: print the runbook of an alert from the installed package."""

from __future__ import annotations

import difflib

import click

from trainwatch import runbooks
from trainwatch.errors import ConfigError


@click.command("runbook")
@click.argument("name", required=False)
@click.option("--list", "list_", is_flag=True, help="List the alerts that have a runbook.")
def runbook(name: str | None, list_: bool) -> None:
    """Print the runbook for alert NAME (e.g. TrainingStalled)."""
    if list_ or not name:
        for n in runbooks.names():
            click.echo(n)
        return
    body = runbooks.text(name)
    if body is None:
        close = difflib.get_close_matches(name, runbooks.names(), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see --list"
        raise ConfigError(f"no runbook for alert '{name}'{hint}")
    click.echo(body, nl=False)
