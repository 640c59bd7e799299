"""``trainwatch checkpoint list|verify|digest DIR``.

DIR is a run directory, a folder of checkpoints, or one checkpoint.  ``verify`` exits 1
when any file does not match its manifest and names the file; ``digest`` prints one hash
of the model weights so two runs can be compared. A DCP checkpoint the job declared
(``tel.checkpoint_saved``) is listed, verified against its ``.metadata`` and digested
through DCP (docs/checkpoints.md, "Declared DCP checkpoints").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

import click

from trainwatch.errors import EXIT_PROBLEM, ConfigError
from trainwatch.config.clitypes import run_dir_option
from trainwatch.rundir.run_dir import RunDir
from trainwatch.checkpoint_format import catalog, dcp
from trainwatch.checkpoint_format.declared import declared_steps, run_checkpoints
from trainwatch.checkpoint_format.manifest import (LAYOUT_DCP, MANIFEST, Verification, step_of,
                                                    verify)


_TARGET_HELP = ("The run directory (or a checkpoint folder, or one checkpoint), if not given as "
                "RUN_DIR.")


def _run_above(path: Path, levels: int) -> RunDir | None:
    """The run directory ``path`` lies in (up to ``levels`` up): its journal says which
    checkpoints the job declared."""
    for parent in list(path.resolve().parents)[:levels]:
        if RunDir(parent).run_file.exists():
            return RunDir(parent)
    return None


def _target(named: RunDir) -> tuple[Path, bool, RunDir | None]:
    """(folder or checkpoint, is_single_checkpoint, the run it belongs to) for what the
    user named."""
    p = named.root
    path = str(p)
    if not p.is_dir():
        raise ConfigError("no such directory", file=path)
    if (p / MANIFEST).exists() or step_of(p.name) is not None or dcp.look(p) is not None:
        return p, True, _run_above(p, 2)
    if named.run_file.exists() or named.checkpoint_dir.is_dir():  # a run directory
        return named.checkpoint_folders()[0], False, named
    return p, False, _run_above(p, 1)


def _entries(named: RunDir) -> tuple[Path, bool, list[catalog.Entry]]:
    """(what was named, is_single_checkpoint, what it holds: checkpoints newest first, then
    the rest). A run directory's include the DCP checkpoints its job declared elsewhere."""
    folder, single, owner = _target(named)
    declared = declared_steps(owner) if owner is not None else {}
    if not single:
        if owner is named:
            return folder, False, run_checkpoints(owner, [folder])
        return folder, False, catalog.scan(folder, declared)
    found = [e for e in catalog.scan(folder.parent, declared) if e.path == folder]
    if not found:  # a DCP directory of any name, declared or not
        entry = catalog.dcp_entry(folder, step_of(folder.name),
                                  catalog.resolved(folder) in declared)
        found = [entry] if entry is not None else []
    return folder, True, found


def _check(path: Path, entry: catalog.Entry | None,
           progress: Callable[[int], None] | None = None) -> Verification:
    """``path`` verified as what it is: against its manifest, or a DCP checkpoint against
    its ``.metadata`` (imports torch)."""
    if entry is not None and entry.kind == dcp.KIND:
        from trainwatch.rank.checkpoint.dcp_verify import verify_dcp

        return verify_dcp(path, entry.step)
    if entry is not None and (entry.manifest or {}).get("layout") == LAYOUT_DCP:
        from trainwatch.rank.checkpoint.dcp_verify import verify_checkpoint

        return verify_checkpoint(path, progress=progress)
    return verify(path, progress=progress)


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
    folder, single, entries = _entries(run)
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
        name = e.path.name if single or e.path.parent == folder else str(e.path)
        table.add_row(name, e.state, human_bytes(e.bytes) if e.bytes else "-",
                      "-" if e.val_loss is None else f"{e.val_loss:.4f}",
                      str(d["world_size"] or "-"), str(d["reason_saved"] or "-"),
                      e.reason or _sharded_note(e))
    Console().print(table if entries else f"no checkpoints in {folder}")


def _sharded_note(entry: catalog.Entry) -> str:
    """``sharded (DCP), 2 shard files`` for a trainwatch checkpoint of sharded state."""
    manifest = entry.manifest or {}
    if manifest.get("layout") != LAYOUT_DCP:
        return ""
    shards = len((manifest.get("dcp") or {}).get("files") or [])
    return f"sharded, {shards} DCP shard{'s' if shards != 1 else ''}"


def _verify_all(targets: list[tuple[Path, catalog.Entry | None]],
                quiet: bool) -> list[Verification]:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    total = 0
    for path, _ in targets:
        try:
            total += sum(p.stat().st_size for p in path.iterdir() if p.is_file())
        except OSError:
            pass
    results = []
    with Progress(TextColumn("verifying {task.description}"), BarColumn(), DownloadColumn(),
                  transient=True, disable=quiet or not sys.stderr.isatty()) as progress:
        task = progress.add_task("", total=total)
        for path, entry in targets:
            progress.update(task, description=path.name)
            results.append(_check(path, entry, lambda n: progress.advance(task, n)))
    return results


DCP_CHECKED = ("DCP: .metadata parses, every file it names is there at its size; DCP "
               "records no digests")


@checkpoint.command("verify")
@run_dir_option(_TARGET_HELP, argument=True, required=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def verify_cmd(run: RunDir, as_json: bool) -> None:
    """Check every file's size and digest against the manifest (a DCP checkpoint: against
    its .metadata); exit 1 on any mismatch."""
    folder, single, entries = _entries(run)
    targets: list[tuple[Path, catalog.Entry | None]] = (
        [(folder, entries[0] if entries else None)] if single
        else [(e.path, e) for e in entries if e.state != "incomplete"])
    results = _verify_all(targets, as_json)
    kinds = [entry.kind if entry is not None else "trainwatch" for _, entry in targets]
    incomplete = [] if single else [str(e.path) for e in entries if e.state == "incomplete"]
    bad = [r for r in results if not r.ok]
    if as_json:
        _emit({"ok": not bad and bool(results),
               "checkpoints": [{**r.as_dict(), "kind": kind} for r, kind in zip(results, kinds)],
               "incomplete": incomplete})
    else:
        for r, kind in zip(results, kinds):
            note = f"  ({DCP_CHECKED})" if r.ok and kind == dcp.KIND else ""
            click.echo(f"{'OK ' if r.ok else 'BAD'} {r.path}{note}")
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
    """Print one sha256 of the model weights (canonical order; a DCP checkpoint: of all
    its tensors); a folder means its newest checkpoint that verifies."""
    folder, single, entries = _entries(run)
    chosen: catalog.Entry | None = entries[0] if single and entries else None
    if not single:
        candidates = [e for e in entries if e.state in catalog.LISTED_FIRST]
        chosen = next((e for e in candidates if _check(e.path, e).ok), None)
        if chosen is None:
            raise ConfigError(f"no checkpoint here verifies ({len(candidates)} complete; "
                              f"`trainwatch checkpoint verify {folder}` says why)"
                              if candidates else "no complete checkpoints here", file=str(folder))
    path = chosen.path if chosen is not None else folder
    if chosen is not None and chosen.kind == dcp.KIND:
        value = _dcp_digest(chosen)
    else:
        from trainwatch.rank.checkpoint.digest import checkpoint_digest  # imports torch

        try:
            value = checkpoint_digest(path)
        except (OSError, RuntimeError) as exc:
            raise ConfigError(f"cannot read model.pt: {exc}", file=str(path)) from None
    if as_json:
        _emit({"path": str(path), "digest": value,
               "kind": chosen.kind if chosen is not None else "trainwatch"})
    else:
        click.echo(f"{value}  {path}")


def _dcp_digest(entry: catalog.Entry) -> str:
    """The digest of a DCP checkpoint's tensors; exit 2 when it does not verify or load."""
    import warnings

    from trainwatch.rank.checkpoint.digest import dcp_digest  # imports torch

    checked = _check(entry.path, entry)
    if not checked.ok:
        raise ConfigError(f"does not verify ({checked.reason}); "
                          f"`trainwatch checkpoint verify {entry.path}`", file=str(entry.path))
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            return dcp_digest(entry.path)
    except (OSError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"cannot load the DCP checkpoint: {str(exc)[:300]}",
                          file=str(entry.path)) from None
