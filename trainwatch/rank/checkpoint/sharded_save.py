"""Write a sharded checkpoint: every rank its own shards, in parallel, then one manifest.

The same directory scheme as data-parallel checkpoints (writer.py): rank 0 makes
``.tmp-step-N-...`` and tells every rank its name; ``torch.distributed.checkpoint.save``
has each rank write its ``__<rank>_<n>.distcp`` shards (no gather: a rank writes what it
holds) and the coordinator ``.metadata``; each rank writes its ``rank-NNNNN.pt`` (RNGs,
data position) and reports its files with their digests, taken as DCP wrote them
(dcp_hashing.py: nothing is read back), or its error, to rank 0 (one gather of small
objects); the NaN/Inf guard looks at the rank's shards on a helper meanwhile. Only when
every rank's files are durable and they cover what ``.metadata`` names does rank 0 write
the manifest (last) and rename the directory to ``step-N``. A rank that failed, or whose
shards hold a NaN/Inf, leaves the save unpublished; the previous checkpoint is untouched.
The directory stays a plain DCP checkpoint: ``torch.distributed.checkpoint.load`` reads it
without trainwatch. An async save splits this: the loop ``stage``s (the directory, this
rank's shards copied to host memory, every rank's agreement), and a writer thread runs
``write_sharded`` on the copy over a gloo group of its own.
"""

from __future__ import annotations

import os
import platform
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from trainwatch import __version__
from trainwatch.checkpoint_format.dcp import METADATA, SHARD_SUFFIX
from trainwatch.checkpoint_format.manifest import (DIGEST, FORMAT, FORMAT_VERSION, LAYOUT_DCP,
                                                    digest_file, rank_file_name, step_dir_name)
from trainwatch.contract.layout import WEIGHTS_CONFIG_DIGEST_KEY
from trainwatch.rank.checkpoint import fsdp1_staging, sharded
from trainwatch.rank.checkpoint.dcp_verify import needed_sizes, read_metadata
from trainwatch.rank.checkpoint.writer import (CheckpointWriteError, CheckRefused, Payload,
                                                  Written, data_position, publish, tmp_dir,
                                                  write_manifest)
from trainwatch.rundir.atomic import fsync_file


def _agree_on_tmp(folder: Path, step: int, rank: int, group: Any) -> tuple[Path | None, str]:
    """Rank 0 makes the staging directory; every rank learns its path (or rank 0's error)."""
    box: list[Any] = [None, ""]
    if rank == 0:
        tmp = tmp_dir(folder, step_dir_name(step))
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            box = [str(tmp), ""]
        except OSError as exc:
            box = [None, f"creating {tmp}: {exc.strerror or exc}"]
    if group is not None:
        dist.broadcast_object_list(box, src=0, group=group)
    return (Path(box[0]) if box[0] else None), box[1]


def _rank_file(tmp: Path, rank: int, mine: dict[str, Any], do_fsync: bool
               ) -> dict[str, Any]:
    """This rank's file beside its DCP shards (RNGs, data position), written, hashed as
    written and fsynced: {name: {digest, bytes}}. Independent of DCP's files, so it is
    written on the helper while DCP writes (its fsync off the save's path)."""
    # Imported here, not at the top: DCP brings DTensor and sympy (~1.1 s of every rank's
    # start, restarts included), which a data-parallel job never needs.
    from trainwatch.rank.checkpoint.dcp_hashing import HashingStream

    path = tmp / rank_file_name(rank)
    with open(path, "xb") as fh:
        stream = HashingStream(fh)
        torch.save({"rank": rank, **mine}, stream)
        fh.flush()
        if do_fsync:
            os.fsync(fh.fileno())
    return {path.name: stream.entry()}


def _dcp_files(tmp: Path, rank: int, do_fsync: bool,
               written: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The digests of the files DCP wrote for this rank, taken as they were written
    (``written``): {name: {digest, bytes}}. DCP fsynced its own files; a file it wrote
    some other way is hashed from disk."""
    files = {}
    prefix = f"__{rank}_"
    names = sorted(p.name for p in tmp.iterdir()
                   if p.name.startswith(prefix) and p.name.endswith(SHARD_SUFFIX))
    if rank == 0:
        names.append(METADATA)
    for name in names:
        size = (tmp / name).stat().st_size
        entry = written.get(name)
        if entry is None:
            if do_fsync:
                fsync_file(tmp / name)
            entry = {DIGEST: digest_file(tmp / name), "bytes": size}
        elif entry["bytes"] != size:  # hashed bytes are not the file's: never seal that
            raise OSError(0, f"{name} is {size} bytes on disk, {entry['bytes']} were written "
                             "(changed while the checkpoint was written)", str(tmp / name))
        files[name] = entry
    return files


def _write_rank(tmp: Path, trees: dict[str, Any], mine: dict[str, Any], rank: int,
                do_fsync: bool, group: Any,
                check: Callable[[Any, str], list[str]] | None) -> dict[str, Any]:
    """This rank's part of the save, as a report for rank 0; never raises an Exception
    (every rank must reach the gather that follows). On a helper while DCP writes the
    shards: this rank's own file, then the guard (``check``) over this rank's shards,
    whose findings still stop the seal."""
    import torch.distributed.checkpoint as dcp

    report: dict[str, Any] = {"rank": rank, "files": {}, "error": None, "found": [],
                              "data": data_position([mine])[0]}
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainwatch-guard") as helper:
            own = helper.submit(_rank_file, tmp, rank, mine, do_fsync)
            checked = None
            if check is not None:  # this rank's shards only: no collective behind a rank's back
                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    torch.cuda.synchronize()  # the helper reads them outside the loop's stream
                local = {k: sharded.local(t) for k, t in trees.items()}
                checked = helper.submit(lambda: [f for k, t in local.items() for f in check(t, k)])
            from trainwatch.rank.checkpoint.dcp_hashing import HashingWriter  # see _rank_file

            writer = HashingWriter(str(tmp), sync_files=do_fsync)
            dcp.save(trees, storage_writer=writer, process_group=group)
            report["files"] = {**own.result(), **_dcp_files(tmp, rank, do_fsync,
                                                             writer.written)}
            report["found"] = checked.result() if checked is not None else []
    except Exception as exc:
        errno_ = getattr(exc, "errno", None)
        report["error"] = f"{type(exc).__name__}: {str(exc).strip()[:500]}"
        report["errno"] = errno_
    return report


def _covered(tmp: Path, files: dict[str, Any], needed: dict[str, int]) -> list[str]:
    """What the DCP metadata names (``needed``) that the ranks' reported files do not hold."""
    problems = [f"{name}: named by {METADATA}, written by no rank" for name in needed
                if name not in files]
    problems += [f"{name}: {files[name]['bytes']} bytes, {METADATA} needs {size}"
                 for name, size in needed.items()
                 if name in files and files[name]["bytes"] < size]
    strays = sorted(p.name for p in tmp.iterdir() if p.name not in files)
    return problems + [f"{name}: written, reported by no rank" for name in strays]


def host_stager() -> Any:
    """What copies a rank's shards to host memory for an async save: what
    ``dcp.async_save`` uses, one plain copy per tensor (``DefaultStager``, made per save
    and closed after it, so no copy outlives its save). From a GPU, DCP's stager that
    keeps pinned host buffers between saves (the caller keeps it). DCP's
    ``BlockingAsyncStager`` without its cache deep-copied every DTensor and then copied it
    again: 2-2.5 shards of memory and ~3x the time (docs/benchmarks.md)."""
    from torch.distributed.checkpoint.staging import (BlockingAsyncStager, DefaultStager,
                                                      StagingOptions)

    if torch.cuda.is_available():
        return BlockingAsyncStager(cache_staged_state_dict=True)
    return DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=False))


def stage(folder: Path, payload: Payload, *, rank: int, group: Any, stager: Any
          ) -> tuple[Path | None, str, dict[str, Any]]:
    """The loop's part of an async save: agree on the staging directory, copy this rank's
    shards to host memory (DCP's stager), and agree that every rank has its copy (one
    all_reduce), so the writers' collectives start on every rank or on none. Returns
    (directory or None, why not, the host copy)."""
    tmp, error = _agree_on_tmp(Path(folder), payload.step, rank, group)
    staged: dict[str, Any] = {}
    if tmp is not None:
        try:
            staged = fsdp1_staging.stage(stager, dict(payload.shared))
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
        except Exception as exc:  # e.g. no host memory
            error = f"rank {rank}: copying the shards to host memory failed: {exc}"
    if group is not None:
        failed = torch.tensor([0.0 if not error else 1.0])
        dist.all_reduce(failed, group=group)
        if failed.item() and not error:
            error = f"{int(failed.item())} rank(s) could not copy their shards to host memory"
    if error and tmp is not None and rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    return (None if error else tmp), error, staged


def write_sharded(folder: Path, payload: Payload, *, rank: int, world_size: int, group: Any,
                  fsync: bool = True, check: Callable[[Any, str], list[str]] | None = None,
                  staged: tuple[Path | None, str] | None = None) -> Written | None:
    """Every rank calls this with its own ``payload`` (``payload.ranks``: its own state
    alone; ``staged``: the directory ``stage`` agreed on, ``payload.shared`` then the host
    copy). Rank 0 returns the published checkpoint, other ranks None; rank 0 raises
    CheckpointWriteError (or CheckRefused) naming each rank that failed."""
    started = time.perf_counter()
    folder = Path(folder)
    trees = dict(payload.shared)
    tmp, error = staged if staged is not None else _agree_on_tmp(folder, payload.step, rank,
                                                                 group)
    if tmp is not None:
        report = _write_rank(tmp, trees, payload.ranks[0], rank, fsync, group, check)
    else:
        report = {"rank": rank, "files": {}, "error": error, "found": []}
    reports: list[Any] = [report]
    if group is not None:
        gathered: list[Any] | None = [None] * world_size if rank == 0 else None
        dist.gather_object(report, gathered, dst=0, group=group)
        reports = gathered or []
    if rank != 0:
        return None
    if tmp is None:
        raise CheckpointWriteError(0, f"saving checkpoint step {payload.step} failed: {error}",
                                   str(folder))
    try:
        return _seal(tmp, folder, payload, reports, trees, world_size, fsync, started)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _seal(tmp: Path, folder: Path, payload: Payload, reports: list[dict[str, Any]],
          trees: dict[str, Any], world_size: int, do_fsync: bool, started: float) -> Written:
    """Rank 0: every rank's files durable and covering the metadata: manifest, publish."""
    failed = [r for r in reports if r.get("error")]
    if failed:
        first = failed[0]
        what = "; ".join(f"rank {r['rank']}: {r['error']}" for r in failed[:3])
        raise CheckpointWriteError(first.get("errno") or 0,
                                   f"saving sharded checkpoint step {payload.step} failed on "
                                   f"{len(failed)} of {world_size} rank(s): {what}", str(tmp))
    found = [f for r in reports for f in r.get("found") or []]
    if found:
        raise CheckRefused(sorted(set(found)))
    files = {name: entry for r in reports for name, entry in r["files"].items()}
    sizes = needed_sizes(read_metadata(tmp))
    problems = _covered(tmp, files, sizes)
    if problems:
        raise CheckpointWriteError(0, f"sharded checkpoint step {payload.step} is incomplete: "
                                      + "; ".join(problems[:5]), str(tmp))
    needed = sorted(sizes)
    manifest = {
        "format": FORMAT, "version": FORMAT_VERSION, "layout": LAYOUT_DCP, "step": payload.step,
        "created_at": time.time(), "reason": payload.reason,
        WEIGHTS_CONFIG_DIGEST_KEY: payload.config_hash, "world_size": world_size,
        "shared": sorted(trees), "metrics": payload.metrics,
        "data_position": [r.get("data") for r in sorted(reports, key=lambda r: r["rank"])],
        "dcp": {"files": needed, "ranks": {str(r["rank"]): sorted(r["files"])
                                           for r in reports}, **sharded.layout(trees)},
        "versions": {"torch": torch.__version__, "trainwatch": __version__,
                     "python": platform.python_version()},
        "files": files,
    }
    try:
        write_manifest(tmp, manifest, do_fsync)
        publish(tmp, folder / step_dir_name(payload.step), do_fsync)
    except OSError as exc:
        raise CheckpointWriteError(exc.errno, f"saving checkpoint step {payload.step} failed: "
                                              f"{exc.strerror or exc}", str(tmp)) from exc
    total = sum(f["bytes"] for f in files.values())
    return Written(folder / step_dir_name(payload.step), total, time.perf_counter() - started)

