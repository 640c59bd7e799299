"""torchrun's own restarts have one default (trainwatch.config.clitypes.MAX_RESTARTS) whichever
command starts the reference trainer: `trainwatch train`, `trainwatch run` and the receiver."""

from __future__ import annotations

import inspect
from pathlib import Path

from click.testing import CliRunner

from trainwatch.control.controller import train_command
from trainwatch.control.run import run
from trainwatch.config.clitypes import MAX_RESTARTS
from trainwatch.trainer.cli import train
from trainwatch.trainer.launcher import LaunchSpec


def _option(command, name):
    return next(p for p in command.params if p.name == name)


def test_every_launch_of_the_reference_trainer_defaults_to_one_restart_count(tmp_path):
    assert _option(train, "max_restarts").default == MAX_RESTARTS
    assert LaunchSpec(tmp_path, 1).max_restarts == MAX_RESTARTS
    assert inspect.signature(train_command).parameters["max_restarts"].default == MAX_RESTARTS
    command = train_command(tmp_path, 1)
    assert command[command.index("--max-restarts") + 1] == str(MAX_RESTARTS)
    for command_ in (train, run):
        help_text = " ".join(CliRunner().invoke(command_, ["--help"]).output.split())
        assert f"default {MAX_RESTARTS})" in help_text or f"default: {MAX_RESTARTS}]" in help_text


def test_the_trainer_doc_states_the_default():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "trainer.md").read_text()
    assert f"`--max-restarts N` (default {MAX_RESTARTS})" in doc
