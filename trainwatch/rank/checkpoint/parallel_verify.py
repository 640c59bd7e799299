"""Verify a checkpoint at resume on every rank at once, each hashing its own share.

Rank 0 chooses the checkpoint to resume from (resume.py's ``select``: newest first, falling
back past any that does not verify). Hashing every file there while the other ranks
waited was a third of a sharded resume (docs/benchmarks.md). Now, for each candidate, rank
0 checks what is cheap (the manifest, sizes, strays) and sends every rank its share of
the files: a rank's own files (``__<rank>_<n>.distcp``, ``rank-NNNNN.pt``, the ones it
is about to load), the rest spread by size. Each rank hashes its share and rank 0 hears
every rank's problems (one gather): the verdict, and so the fallback, is the same as
one rank hashing everything, in about 1/world of the time.

A file a rank hashes that it also loads (``wanted``: a data-parallel tree, its own rank
file) is loaded in the same pass (verified_load.py): ``take`` hands those values to the
load once the verdict is in, so no byte is read twice. With no group (one process) rank 0
hashes, and loads, everything itself.

    verifier = ParallelVerify(rank, world_size, group)
    if rank == 0:
        try:
            chosen, passed_over = select(folders, check=verifier.verify)
        finally:
            verifier.done()           # always: the other ranks wait for it
    else:
        verifier.serve()              # answers each candidate until done()
    preloaded = verifier.take(path)   # every rank: what it loaded of the chosen one
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch.distributed as dist

from trainwatch.checkpoint_format.manifest import (LAYOUT_DCP, Verification, check_file,
                                                    verify)
from trainwatch.rank.checkpoint.dcp_verify import covers
from trainwatch.rank.checkpoint.resume import wanted_files
from trainwatch.rank.checkpoint.verified_load import load_verified

_OWNER = re.compile(r"^(?:__(\d+)_\d+\.distcp|rank-(\d+)\.pt)$")


def shares(files: dict[str, dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
    """{name: entry} for each rank to hash: a file a rank wrote (by its name) to that rank
    where it is in this job, every other file (``.metadata``, data-parallel trees, a
    bigger job's shards) to the rank with the fewest bytes so far, biggest first."""
    out: list[dict[str, Any]] = [{} for _ in range(world_size)]
    load = [0] * world_size
    rest = []
    for name, entry in files.items():
        match = _OWNER.match(name)
        owner = int(match.group(1) or match.group(2)) if match else world_size
        if owner < world_size:
            out[owner][name] = entry
            load[owner] += entry["bytes"]
        else:
            rest.append(name)
    for name in sorted(rest, key=lambda n: (-files[n]["bytes"], n)):
        least = load.index(min(load))
        out[least][name] = files[name]
        load[least] += files[name]["bytes"]
    return out


def check_share(directory: Path, share: dict[str, Any], wanted: Any = (),
                loaded: dict[str, Any] | None = None) -> list[str]:
    """What is wrong with this rank's share of the files (never raises: every rank must
    reach the gather). Files also ``wanted`` are loaded while hashed, into ``loaded``."""
    problems = []
    for name, entry in sorted(share.items()):
        try:
            if name in wanted and loaded is not None:
                value, problem = load_verified(directory, name, entry)
                if problem is None:
                    loaded[name] = value
            else:
                _, problem = check_file(directory, name, entry)
        except Exception as exc:
            problem = f"{name}: could not be verified ({type(exc).__name__}: {exc})"
        if problem:
            problems.append(problem)
    return problems


class ParallelVerify:
    """Rank 0 asks (``verify``, then ``done``); every other rank answers (``serve``)."""

    def __init__(self, rank: int, world_size: int, group: Any):
        self.rank, self.world_size, self.group = rank, world_size, group
        self.loaded: dict[str, Any] = {}  # of the last candidate: file name -> value
        self.loaded_from: Path | None = None

    def verify(self, directory: Path) -> Verification:
        """Rank 0: ``directory`` checked as ``verify_checkpoint`` checks it, the hashing
        spread over every rank."""
        result = verify(directory, full=False)  # manifest, sizes, strays: no hashing
        if not result.ok or result.manifest is None:
            return result
        manifest = result.manifest
        if self.group is None:  # one process: every file is mine to hash
            mine = self._check(directory, manifest["files"],
                               wanted_files(manifest, self.rank, self.world_size))
            result.problems += mine
        else:
            assigned = shares(manifest["files"], self.world_size)
            wanted = [wanted_files(manifest, r, self.world_size) for r in range(self.world_size)]
            mine = self._round(directory, assigned, wanted)
            gathered: list[Any] = [None] * self.world_size
            dist.gather_object(mine, gathered, dst=0, group=self.group)
            result.problems += [p for problems in gathered for p in problems or []]
        if not result.problems and manifest.get("layout") == LAYOUT_DCP:
            result.problems += covers(directory, manifest)
        result.ok = not result.problems
        return result

    def done(self) -> None:
        """Rank 0: no more checkpoints to verify; the other ranks return from ``serve``."""
        if self.group is not None:
            dist.broadcast_object_list([None, None, None], src=0, group=self.group)

    def serve(self) -> None:
        """Every rank but 0: hash my share of each checkpoint rank 0 asks about."""
        while True:
            box: list[Any] = [None, None, None]
            dist.broadcast_object_list(box, src=0, group=self.group)
            if box[0] is None:
                return
            mine = self._check(Path(box[0]), box[1][self.rank], box[2][self.rank])
            dist.gather_object(mine, None, dst=0, group=self.group)

    def take(self, directory: Path) -> dict[str, Any]:
        """What this rank loaded while verifying ``directory`` (the chosen checkpoint), once;
        anything loaded of another candidate is dropped."""
        loaded = self.loaded if self.loaded_from == Path(directory) else {}
        self.loaded, self.loaded_from = {}, None
        return loaded

    def _check(self, directory: Path, share: dict[str, Any], wanted: list[str]) -> list[str]:
        self.loaded, self.loaded_from = {}, directory  # a candidate before: let it go first
        return check_share(directory, share, set(wanted), self.loaded)

    def _round(self, directory: Path, assigned: list[dict[str, Any]],
               wanted: list[list[str]]) -> list[str]:
        dist.broadcast_object_list([str(directory), assigned, wanted], src=0, group=self.group)
        return self._check(directory, assigned[0], wanted[0])
