"""``trainwatch checkpoint list|verify|digest DIR``.

DIR is a run directory, a folder of checkpoints, or one checkpoint.  ``verify`` exits 1
when any file does not match its manifest and names the file; ``digest`` prints one hash
of the model weights so two runs can be compared.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from trainwatch.errors import EXIT_PROBLEM, ConfigError
from trainwatch.config.clitypes import run_dir_option
from trainwatch.rundir.run_dir import RunDir
from trainwatch.checkpoint_format import catalog
from trainwatch.checkpoint_format.manifest import MANIFEST, Verification, step_of, verify


_TARGET_HELP = ("The run directory (or a checkpoint folder, or one checkpoint), if not given as "
                "RUN_DIR.")


def _target(named: RunDir) -> tuple[Path, bool]:
    """(folder or checkpoint, is_single_checkpoint) for what the user named."""
    p = named.root
    path = str(p)
    if not p.is_dir():
        raise ConfigError("no such directory", file=path)
    if (p / MANIFEST).exists() or step_of(p.name) is not None:
        return p, True
    if named.run_file.exists() or named.checkpoint_dir.is_dir():  # a run directory
        return named.checkpoint_folders()[0], False
    return p, False


def _emit(obj: object) -> None:
    click.echo(json.dumps(obj, indent=1, default=str))


@click.group()
def checkpoint() -> None:
    """Inspect, verify and compare checkpoints (format: docs/checkpoints.md)."""


@checkpoint.command("list")
@run_dir_option(_TARGET_HELP, argument=True, required=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def list_cmd(run: RunDir, as_json: bool) -> None:
    """List checkpoints, newest first, with leftovers of interrupted saves (no hashing)."""
    folder, single = _target(run)
    entries = catalog.scan(folder.parent if single else folder)
    if single:
        entries = [e for e in entries if e.path == folder]
    if as_json:
        _emit([e.as_dict() for e in entries])
        return
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from trainwatch.units import human_bytes

    table = Table(box=box.SIMPLE_HEAD)
    table.add_column("checkpoint", no_wrap=True)
    for name in ("state", "size", "val_loss", "ranks", "why", "note"):
        table.add_column(name, justify="right" if name == "size" else "left")
    for e in entries:
        d = e.as_dict()
        table.add_row(e.path.name, e.state, human_bytes(e.bytes) if e.bytes else "-",
                      "-" if e.val_loss is None else f"{e.val_loss:.4f}",
                      str(d["world_size"] or "-"), str(d["reason_saved"] or "-"), e.reason)
    Console().print(table if entries else f"no checkpoints in {folder}")


def _verify_all(targets: list[Path], quiet: bool) -> list[Verification]:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    total = 0
    for path in targets:
        try:
            total += sum(p.stat().st_size for p in path.iterdir() if p.is_file())
        except OSError:
            pass
    results = []
    with Progress(TextColumn("verifying {task.description}"), BarColumn(), DownloadColumn(),
                  transient=True, disable=quiet or not sys.stderr.isatty()) as progress:
        task = progress.add_task("", total=total)
        for path in targets:
            progress.update(task, description=path.name)
            results.append(verify(path, progress=lambda n: progress.advance(task, n)))
    return results


@checkpoint.command("verify")
@run_dir_option(_TARGET_HELP, argument=True, required=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def verify_cmd(run: RunDir, as_json: bool) -> None:
    """Check every file's size and digest against the manifest; exit 1 on any mismatch."""
    folder, single = _target(run)
    entries = [] if single else catalog.scan(folder)
    targets = [folder] if single else [e.path for e in entries if e.state != "incomplete"]
    results = _verify_all(targets, as_json)
    incomplete = [str(e.path) for e in entries if e.state == "incomplete"]
    bad = [r for r in results if not r.ok]
    if as_json:
        _emit({"ok": not bad and bool(results), "checkpoints": [r.as_dict() for r in results],
               "incomplete": incomplete})
    else:
        for r in results:
            click.echo(f"{'OK ' if r.ok else 'BAD'} {r.path}")
            for problem in r.problems:
                click.echo(f"    {problem}")
        for path in incomplete:
            click.echo(f"--  {path}  (interrupted save; ignored by resume)")
        if not results:
            click.echo(f"no checkpoints in {folder}", err=True)
    if bad or not results:
        sys.exit(EXIT_PROBLEM)


@checkpoint.command("digest")
@run_dir_option(_TARGET_HELP, argument=True, required=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def digest_cmd(run: RunDir, as_json: bool) -> None:
    """Print one sha256 of the model weights (canonical order); a folder means its newest
    checkpoint that verifies."""
    folder, single = _target(run)
    chosen = folder
    if not single:
        candidates = catalog.complete(folder)
        verified = next((e.path for e in candidates if verify(e.path).ok), None)
        if verified is None:
            raise ConfigError(f"no checkpoint here verifies ({len(candidates)} complete; "
                              f"`trainwatch checkpoint verify {folder}` says why)"
                              if candidates else "no complete checkpoints here", file=str(folder))
        chosen = verified
    from trainwatch.rank.checkpoint.digest import checkpoint_digest  # imports torch

    try:
        value = checkpoint_digest(chosen)
    except (OSError, RuntimeError) as exc:
        raise ConfigError(f"cannot read model.pt: {exc}", file=str(chosen)) from None
    if as_json:
        _emit({"path": str(chosen), "digest": value})
    else:
        click.echo(f"{value}  {chosen}")
