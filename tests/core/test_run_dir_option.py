"""``--run-dir`` is one shared option (trainwatch.config.clitypes.run_dir_option): every command
spells, checks and builds the run directory the same way, RUN_DIR or --run-dir."""

from __future__ import annotations

import click
from click.testing import CliRunner

from conftest import all_commands
from trainwatch.config.clitypes import run_dir_option
from trainwatch.errors import EXIT_USAGE

# The agent watches several run directories (--run-dir repeated): a list, not one RunDir.
SEVERAL = {"trainwatch agent"}


def test_every_command_declares_the_run_dir_by_the_shared_option():
    declared = {name: param for name, cmd in all_commands() for param in cmd.params
                if "--run-dir" in getattr(param, "opts", ()) and name not in SEVERAL}
    assert len(declared) >= 14
    odd = {name: (p.name, p.metavar) for name, p in declared.items()
           if (p.name, p.metavar) != ("run_dir_opt", "RUN_DIR")}
    assert odd == {}


def _command(**how):
    @click.command()
    @run_dir_option("The run directory.", **how)
    def show(run) -> None:
        click.echo("none" if run is None else f"{type(run).__name__} {run.root}")
    return show


def _invoke(command, *args):
    """The result, with a ConfigError (which trainwatch.cli.main prints, exit 2) kept."""
    return CliRunner().invoke(command, list(args), standalone_mode=False)


def test_the_option_builds_one_run_dir_from_either_form(tmp_path):
    both = _command(argument=True, required=True)
    for args in ([str(tmp_path)], ["--run-dir", str(tmp_path)],
                 [str(tmp_path), "--run-dir", str(tmp_path)]):
        assert _invoke(both, *args).output == f"RunDir {tmp_path}\n"
    assert "two run directories given" in str(_invoke(both, "a", "--run-dir", "b").exception)
    assert "no run directory given" in str(_invoke(both).exception)


def test_optional_and_required_options(tmp_path):
    assert _invoke(_command()).output == "none\n"
    required = CliRunner().invoke(_command(required=True), [])
    assert required.exit_code == EXIT_USAGE and "Missing option '--run-dir'" in required.output
    (tmp_path / "file").write_text("")
    a_file = CliRunner().invoke(_command(), ["--run-dir", str(tmp_path / "file")])
    assert a_file.exit_code == EXIT_USAGE and "is a file" in a_file.output


def _refuses_empty(cmd: click.Command, param: click.Parameter) -> bool:
    """The parameter's type refuses "" and " " (checked on the type: the old one let
    the command run in the working directory, which a test must not do)."""
    ctx = click.Context(cmd)
    for value in ("", " "):
        try:
            param.type.convert(value, param, ctx)
        except click.BadParameter:
            continue
        return False
    return True


def test_an_empty_run_dir_is_a_usage_error_in_every_command():
    """click reads "" as the working directory: `alerts receive --run-dir ""` (an unset
    shell variable) ran the job wherever the command started. Every form, every command."""
    folders = [(name, cmd, p) for name, cmd in all_commands() for p in cmd.params
               if {"--run-dir", "--discover"} & set(getattr(p, "opts", ()))
               or p.name in ("run_dir_arg", "positional", "run_dir_args")]
    assert len(folders) >= 20
    assert [(name, p.name) for name, cmd, p in folders if not _refuses_empty(cmd, p)] == []
    commands = dict(all_commands())
    for args in (["--run-dir", ""], [""]):
        given = CliRunner().invoke(commands["trainwatch diagnose"], args)
        assert given.exit_code == EXIT_USAGE and "is empty; give a folder" in given.output
        assert ("'--run-dir'" if args[0] else "'[RUN_DIR]'") in given.output
