"""``trainwatch runbook NAME``: print the runbook of an alert from the installed package.

Formatted (rich's Markdown: headings, lists, highlighted commands) on a terminal, where
someone reads it at 3 a.m.; the Markdown itself when piped or with ``--raw``, so commands
can be copied or grepped as written.
"""

from __future__ import annotations

import difflib

import click
from rich.console import Console
from rich.markdown import Markdown

from trainwatch import runbooks
from trainwatch.errors import ConfigError


@click.command("runbook")
@click.argument("name", required=False)
@click.option("--list", "list_", is_flag=True, help="List the alerts that have a runbook.")
@click.option("--raw", is_flag=True, help="Print the Markdown as it is (default when piped).")
def runbook(name: str | None, list_: bool, raw: bool) -> None:
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
    console = Console()
    if raw or not console.is_terminal:
        click.echo(body, nl=False)
        return
    console.print(Markdown(body, code_theme="ansi_dark"))
