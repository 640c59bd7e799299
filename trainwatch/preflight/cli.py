"""``trainwatch preflight``: is this node fit to join a training job?"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console

from trainwatch.config.clitypes import run_dir_option, seconds
from trainwatch.errors import ConfigError
from trainwatch.node import node_name
from trainwatch.preflight.model import GROUPS

if TYPE_CHECKING:
    from trainwatch.rundir.run_dir import RunDir


def _pins(values: tuple[str, ...]) -> dict[str, str]:
    from trainwatch.preflight.settings import check_version_names

    pins = {}
    for text in values:
        name, sep, version = text.partition("=")
        if not sep or not name.strip() or not version.strip():
            raise ConfigError(f"'{text}' is not NAME=VERSION", key="--expect-version")
        pins[name.strip()] = version.strip()
    check_version_names(pins, file=None, key="--expect-version")
    return pins


def _size(value: str | None) -> int | None:
    from trainwatch.preflight.settings import parse_size

    return None if value is None else parse_size(value, file=None, key="--checkpoint-bytes")


@click.command("preflight", context_settings={"help_option_names": ["-h", "--help"]})
@run_dir_option("The job's run directory: must exist, take writes and have room.")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where checkpoints go [default: inside --run-dir].")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path),
              help="The data set: must exist and be readable (writable if configured).")
@click.option("--checkpoint-bytes", metavar="SIZE",
              help="Size of one checkpoint (e.g. 40GiB): free space for "
                   "storage.checkpoint_room of them is required.")
@click.option("--expect-gpus", type=click.IntRange(min=0), metavar="N",
              help="GPUs this node must have (fail if NVML sees another number or none).")
@click.option("--xid-watch", type=seconds(), metavar="SECONDS",
              help="Watch this long for GPU XID events [default: 0, no watch].")
@click.option("--peer", "peers", multiple=True, metavar="HOST:PORT",
              help="A host the job talks to (another node, storage): TCP connect must "
                   "succeed. Repeatable.")
@click.option("--master", metavar="HOST:PORT",
              help="MASTER_ADDR:MASTER_PORT of the job: the host must answer.")
@click.option("--expect-version", "pins", multiple=True, metavar="NAME=VERSION",
              help="Pin a version (torch, torch_cuda, nccl, cuda, driver, python, "
                   "trainwatch), e.g. torch=2.13.0. Repeatable.")
@click.option("--python", type=click.Path(dir_okay=False), metavar="PATH",
              help="The job's Python interpreter, for the torch/NCCL versions "
                   "[default: the one running preflight].")
@click.option("--only", "only", multiple=True, type=click.Choice(GROUPS),
              help="Run only these check groups. Repeatable.")
@click.option("--skip", "skip", multiple=True, type=click.Choice(GROUPS),
              help="Skip these check groups. Repeatable.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False, path_type=Path),
              help="YAML thresholds (see --print-defaults); keys left out keep defaults.")
@click.option("--sys-root", metavar="DIR", help="Read /sys from here (overrides the config).")
@click.option("--proc-root", metavar="DIR", help="Read /proc from here (overrides the config).")
@click.option("--strict", is_flag=True, help="A warning fails too (exit 1).")
@click.option("--json", "as_json", is_flag=True,
              help="Print a JSON report for machines (keys: docs/preflight.md).")
@click.option("--print-defaults", is_flag=True,
              help="Print the commented default thresholds (a --config template) and exit.")
def preflight(run: RunDir | None, checkpoint_dir: Path | None, data_dir: Path | None,
              checkpoint_bytes: str | None, expect_gpus: int | None, xid_watch: float | None,
              peers: tuple[str, ...], master: str | None, pins: tuple[str, ...],
              python: str | None, only: tuple[str, ...], skip: tuple[str, ...],
              config_file: Path | None, sys_root: str | None, proc_root: str | None,
              strict: bool, as_json: bool, print_defaults: bool) -> None:
    """Check that this node is fit to (re)start a training job on: GPUs (NVML), storage,
    host limits and leftovers, network, software versions.

    Run it from a Slurm prolog, a Kubernetes init container or by hand before a job
    starts, as the job's user.  Exit code 0: fit; 1: a check failed (or warned, with
    --strict); 2: bad usage or config.
    """
    from trainwatch.preflight import render
    from trainwatch.preflight.model import Request, worst
    from trainwatch.preflight.network import parse_address
    from trainwatch.preflight.runner import run_checks
    from trainwatch.preflight.settings import defaults_text, load_settings

    if print_defaults:
        click.echo(defaults_text(), nl=False)
        return
    settings = load_settings(config_file)
    if expect_gpus is not None:
        settings["gpu"]["expect_count"] = expect_gpus
    if xid_watch is not None:
        settings["gpu"]["xid_watch_seconds"] = xid_watch
    settings["software"]["expect_versions"].update(_pins(pins))
    settings["sys_root"] = sys_root or settings["sys_root"]
    settings["proc_root"] = proc_root or settings["proc_root"]
    groups = tuple(g for g in (only or GROUPS) if g not in skip)
    request = Request(run_dir=run.root if run is not None else None,
                      checkpoint_dir=checkpoint_dir, data_dir=data_dir,
                      checkpoint_bytes=_size(checkpoint_bytes),
                      peers=[parse_address(p, "--peer") for p in peers],
                      master=parse_address(master, "--master") if master else None,
                      python=python, groups=groups)

    err = Console(stderr=True)
    if err.is_terminal and not as_json:
        with err.status("preflight…") as status:
            checks = run_checks(request, settings,
                                progress=lambda g: status.update(f"preflight: {g} checks…"))
    else:
        checks = run_checks(request, settings)
    exit_code = worst(checks, strict)
    data = render.report(checks, node=node_name(), strict=strict, exit_code=exit_code)
    if as_json:
        click.echo(render.to_json(data))
    else:
        console = Console()
        render.render(data, console if console.is_terminal else Console(width=120))
    sys.stdout.flush()
    sys.exit(exit_code)
