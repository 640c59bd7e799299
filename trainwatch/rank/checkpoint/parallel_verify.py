"""Verify a checkpoint at resume on every rank at once, each hashing its own share.

Rank 0 chooses the checkpoint to resume from (resume.py's ``select``: newest first, falling
back past any that does not verify). Hashing every file there while the other ranks
waited was a third of a sharded resume (docs/benchmarks.md). Now, for each candidate, rank
0 checks what is cheap (the manifest, sizes, strays) and sends every rank the manifest;
each rank hashes its share of the files (``shares``: a rank's own files,
``__<rank>_<n>.distcp``, ``rank-NNNNN.pt``, the ones it is about to load; ``.metadata`` to
rank 0; the rest spread by size) and one all-gather gives every rank every rank's
problems: the verdict, and so the fallback, is the same as one rank hashing everything,
in about 1/world of the time. Rank 0 adds to the gather what only it checks: a sharded
checkpoint's files against its ``.metadata`` (``covers``, once it has hashed that file
itself), and whether this job may resume it at all (``decide``: another config is
refused). So a candidate that verifies is the decision on every rank, with no more
collectives; only when none verifies does ``done`` tell the others so.

The first candidate needs no broadcast: every rank's helper thread (early_digests.py) has
read the manifest of the newest step directory, the one rank 0 tries first, and hashed
its share of that while rank 0 listed and checked; the one all-gather then also carries
which directory and which manifest (a digest of it) each rank hashed. When they are rank
0's, the verdict is the one the broadcast would have given (the same files, hashed
against the same entries); when any rank read another (rank 0 passed over the newest, or
its mirror holds a newer step), that round is redone the usual way, rank 0 sending its
manifest. When rank 0 finds no candidate at all, its decision comes in that first gather.

A file a rank hashes that it also loads (``wanted``: a data-parallel tree, its own rank
file) is loaded in the same pass (verified_load.py): ``take`` hands those values to the
load once the verdict is in, so no byte is read twice. With no group (one process) rank 0
hashes, and loads, everything itself.

    verifier = ParallelVerify(rank, world_size, group, decide)
    if rank == 0:
        try:
            chosen, passed_over = select(folders, check=verifier.verify)
            decision = ...            # decide(chosen), an error, or {} for none
        finally:
            verifier.done(decision)   # always: tells the others when they still wait
    else:
        decision = verifier.serve()   # answers each candidate until one verifies, or done()
    preloaded = verifier.take(path)   # every rank: what it loaded of the chosen one
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import xxhash

from trainwatch.checkpoint_format.dcp import METADATA
from trainwatch.checkpoint_format.manifest import (DIGEST, LAYOUT_DCP, Verification,
                                                    check_file, digest_algorithm,
                                                    digest_mismatch, verify)
from trainwatch.rank.checkpoint.dcp_verify import covers
from trainwatch.rank.checkpoint.early_digests import EarlyDigests
from trainwatch.rank.checkpoint.resume import wanted_files
from trainwatch.rank.checkpoint.verified_load import load_verified
from trainwatch.rank.object_gather import gather_objects

_OWNER = re.compile(r"^(?:__(\d+)_\d+\.distcp|rank-(\d+)\.pt)$")


def shares(files: dict[str, dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
    """{name: entry} for each rank to hash: a file a rank wrote (by its name) to that rank
    where it is in this job, ``.metadata`` to rank 0 (which checks the manifest against
    it), every other file (data-parallel trees, a bigger job's shards) to the rank with
    the fewest bytes so far, biggest first."""
    out: list[dict[str, Any]] = [{} for _ in range(world_size)]
    load = [0] * world_size
    rest = []
    for name, entry in files.items():
        match = _OWNER.match(name)
        owner = (int(match.group(1) or match.group(2)) if match
                 else 0 if name == METADATA else world_size)
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
                loaded: dict[str, Any] | None = None, early: EarlyDigests | None = None
                ) -> list[str]:
    """What is wrong with this rank's share of the files (never raises: every rank must
    reach the gather). Files also ``wanted`` are loaded while hashed, into ``loaded``;
    a file ``early`` hashed since resume began is not hashed again."""
    problems = []
    for name, entry in sorted(share.items()):
        try:
            if name in wanted and loaded is not None:
                found, value = (early.value(directory, name, entry) if early is not None
                                else (False, None))
                problem = None
                if not found:  # not loaded (and verified) by the helper thread: now
                    value, problem = load_verified(directory, name, entry)
                if problem is None:
                    loaded[name] = value
            else:
                problem = _early_problem(directory, name, entry, early)
        except Exception as exc:
            problem = f"{name}: could not be verified ({type(exc).__name__}: {exc})"
        if problem:
            problems.append(problem)
    return problems


# What decides a verified candidate: {"path", "manifest"} to resume it, {"error", "file"}
# to refuse it (another config's); rank 0 runs it, every rank gets its answer.
Decide = Callable[[Path, dict[str, Any]], dict[str, Any]]


def fingerprint(manifest: dict[str, Any]) -> str:
    """What tells two ranks they hashed against the same manifest (its xxh3-128, canonical)."""
    text = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    return xxhash.xxh3_128_hexdigest(text.encode())


def _early_problem(directory: Path, name: str, entry: dict[str, Any],
                   early: EarlyDigests | None) -> str | None:
    """``check_file``'s verdict on the file, its digest taken from ``early`` when it
    hashed this very file."""
    digest = early.digest(directory, name) if early is not None else None
    if digest is not None and digest_algorithm(entry) == DIGEST:
        _, problem = check_file(directory, name, entry, full=False)  # its size, as listed
        if problem is None and digest != entry[DIGEST]:
            problem = digest_mismatch(name, DIGEST)
        return problem
    return check_file(directory, name, entry)[1]


class ParallelVerify:
    """Rank 0 asks (``verify``, then ``done``); every other rank answers (``serve``)."""

    def __init__(self, rank: int, world_size: int, group: Any, decide: Decide | None = None,
                 early: EarlyDigests | None = None):
        self.rank, self.world_size, self.group = rank, world_size, group
        self.early = early  # this rank's shards, hashed since resume began
        self.decide: Decide = decide or (lambda path, manifest: {"path": str(path),
                                                                 "manifest": manifest})
        self.loaded: dict[str, Any] = {}  # of the last candidate: file name -> value
        self.loaded_from: Path | None = None
        self.decision: dict[str, Any] | None = None  # of the candidate that verified
        self._waiting = group is not None  # the other ranks are in ``serve``
        self._first = group is not None  # the next collective is the first round's gather

    def verify(self, directory: Path) -> Verification:
        """Rank 0: ``directory`` checked as ``verify_checkpoint`` checks it, the hashing
        spread over every rank."""
        result = verify(directory, full=False)  # manifest, sizes, strays: no hashing
        if not result.ok or result.manifest is None:
            return result
        manifest = result.manifest
        problems = self._first_round(directory, manifest) if self._first else None
        if problems is None:  # not the first, or another rank hashed another manifest
            if self.group is not None:
                dist.broadcast_object_list([str(directory), manifest], src=0, group=self.group)
            problems = self._round(directory, manifest)
        result.problems += problems
        result.ok = not result.problems
        return result

    def done(self, decision: dict[str, Any] | None = None) -> None:
        """Rank 0: no more checkpoints to verify; ``decision`` goes to the other ranks when
        no candidate verified (when one did, they have it from that round)."""
        if self._waiting:
            self._waiting = False
            if self._first:  # no candidate was sent: the others are in the first gather
                self._first_round(None, None, done=decision or {})
            else:
                dist.broadcast_object_list([None, decision or {}], src=0, group=self.group)

    def serve(self) -> dict[str, Any]:
        """Every rank but 0: hash my share of each checkpoint rank 0 asks about, until one
        verifies (its decision) or rank 0 is done (the decision it sends). The first: the
        newest step directory, as the helper thread read its manifest."""
        if self._first:
            guess = self.early.guess() if self.early is not None else None
            self._first_round(*(guess or (None, None)))
            if self.decision is not None:
                return self.decision
        while True:
            box: list[Any] = [None, None]
            dist.broadcast_object_list(box, src=0, group=self.group)
            if box[0] is None:
                return box[1]
            self._round(Path(box[0]), box[1])
            if self.decision is not None:
                return self.decision

    def take(self, directory: Path) -> dict[str, Any]:
        """What this rank loaded while verifying ``directory`` (the chosen checkpoint), once;
        anything loaded of another candidate is dropped."""
        loaded = self.loaded if self.loaded_from == Path(directory) else {}
        self.loaded, self.loaded_from = {}, None
        return loaded

    def _first_round(self, directory: Path | None, manifest: dict[str, Any] | None,
                     done: dict[str, Any] | None = None) -> list[str] | None:
        """Every rank: ``_round`` of the manifest it read itself (rank 0: its first
        candidate's; the others: the newest step directory's), without the broadcast, the
        directory and manifest digest gathered with the problems. The problems when every
        rank hashed rank 0's; None when any did not (the round is redone with the
        broadcast), or when rank 0 was ``done`` (its decision then set here)."""
        self._first = False
        key = None
        if directory is not None and manifest is not None and done is None:
            try:
                key = (str(directory), fingerprint(manifest))
            except Exception:  # every rank must reach the gather: the usual round follows
                key = None
        mine, extra = self._hash(directory, manifest) if key is not None else ([], ([], None))
        gathered = self._gather((mine, extra, key, done))
        if gathered[0][3] is not None:  # rank 0 had no candidate: its decision
            self.decision, self._waiting = gathered[0][3], False
            return None
        if key is None or any(theirs[2] != gathered[0][2] for theirs in gathered):
            return None
        assert directory is not None and manifest is not None
        return self._verdict(gathered, manifest)

    def _round(self, directory: Path, manifest: dict[str, Any]) -> list[str]:
        """Every rank: hash my share of ``directory``; the problems of all shares, and of
        what rank 0 checks besides (one all-gather). Sets ``decision`` when none."""
        mine, extra = self._hash(directory, manifest)
        return self._verdict(self._gather((mine, extra)), manifest)

    def _hash(self, directory: Path | None, manifest: dict[str, Any] | None
              ) -> tuple[list[str], tuple[list[str], dict[str, Any] | None]]:
        """My share's problems, and rank 0's own checks when its share is clean."""
        assert directory is not None and manifest is not None
        self.loaded, self.loaded_from = {}, directory  # a candidate before: let it go first
        share = shares(manifest["files"], self.world_size)[self.rank]
        wanted = set(wanted_files(manifest, self.rank, self.world_size))
        mine = check_share(directory, share, wanted, self.loaded, self.early)
        extra: tuple[list[str], dict[str, Any] | None] = ([], None)
        if self.rank == 0 and not mine:  # .metadata hashed here: its layout can be read
            extra = self._rank0_checks(directory, manifest)
        return mine, extra

    def _gather(self, mine: tuple[Any, ...]) -> list[Any]:
        return gather_objects(mine, self.group)  # one message a rank when small

    def _verdict(self, gathered: list[Any], manifest: dict[str, Any]) -> list[str]:
        """Every rank's problems, then rank 0's checks; ``decision`` when none."""
        problems = [p for theirs in gathered for p in theirs[0]]
        covered, decision = gathered[0][1]
        problems = problems or list(covered)
        if not problems:
            assert decision is not None, "rank 0 decides every candidate it found clean"
            if "path" in decision:  # the manifest came with the request, not again
                decision = {**decision, "manifest": manifest}
            self.decision, self._waiting = decision, False
        return problems

    def _rank0_checks(self, directory: Path, manifest: dict[str, Any]
                      ) -> tuple[list[str], dict[str, Any]]:
        """Rank 0, its share clean: a sharded checkpoint's files against its
        ``.metadata``, and what this job would do with the candidate (``decide``). Never
        raises: the other ranks are on their way to the gather."""
        try:
            covered = covers(directory, manifest) if manifest.get("layout") == LAYOUT_DCP else []
            decision = self.decide(directory, manifest)
        except Exception as exc:
            return [f"{METADATA}: could not be checked ({type(exc).__name__}: {exc})"], {}
        return covered, {k: v for k, v in decision.items() if k != "manifest"}
