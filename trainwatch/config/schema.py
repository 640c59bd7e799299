"""``trainwatch config schema``: the JSON Schema of every config file, for editors.

The models live with their components; this table names them as strings (like the
commands in ``cli.py``) so the shared core imports no component.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import click

# config name -> ("module:attribute" of its model, or of a function returning it; title;
# for a config whose defaults are in a file of their own (a user's file holds only what it
# changes), "module:attribute" of the function that loads them, else None)
SCHEMAS: dict[str, tuple[str, str, str | None]] = {
    "agent": ("trainwatch.agent.config:agent_settings_model",
              "trainwatch agent config (trainwatch agent --config)", None),
    "preflight": ("trainwatch.preflight.settings:PreflightSettings",
                  "trainwatch preflight config (trainwatch preflight --config)",
                  "trainwatch.preflight.settings:load_settings"),
    "thresholds": ("trainwatch.alerts.rules:thresholds_model",
                   "trainwatch alert thresholds (--thresholds FILE)",
                   "trainwatch.alerts.rules:load_thresholds"),
    "trainer": ("trainwatch.trainer.config:Config",
                "trainwatch trainer config (trainwatch train --config)", None),
}
SCHEMA_DIR = "deploy/schemas"


def _resolve(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def model_of(name: str) -> Any:
    model = _resolve(SCHEMAS[name][0])
    if callable(model) and not isinstance(model, type):
        model = model()
    return model


def schema_text(name: str) -> str:
    """The schema as the committed file holds it: sorted keys, stable bytes."""
    from trainwatch.config.model import json_schema

    _, title, defaults = SCHEMAS[name]
    values = _resolve(defaults)(None) if defaults else None
    schema = json_schema(model_of(name), title, defaults=values)
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


@click.group()
def config() -> None:
    """Config files: their JSON Schemas for editors (yaml-language-server, VS Code)."""


@config.command()
@click.argument("name", type=click.Choice(sorted(SCHEMAS)))
def schema(name: str) -> None:
    """Print the JSON Schema of the NAME config file."""
    click.echo(schema_text(name), nl=False)


@config.command("export")
@click.option("--output-dir", type=click.Path(file_okay=False), default=SCHEMA_DIR,
              show_default=True, help="Write NAME.json for every config here.")
def export(output_dir: str) -> None:
    """Write every config's JSON Schema (the committed copies are in deploy/schemas/)."""
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    for name in sorted(SCHEMAS):
        (folder / f"{name}.json").write_text(schema_text(name))
        click.echo(folder / f"{name}.json")
