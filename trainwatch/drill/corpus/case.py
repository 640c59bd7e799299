"""A corpus case: one kind of fault, how it is injected into the corpus job, and the answer
``trainwatch diagnose`` must give (the culprit rank and the cause).

Each kind is one module of ``trainwatch/drill/corpus/cases/`` defining ``CASE``; adding a
kind adds a file. The hooks run inside the job's ranks (``fault``, ``every_step``,
``item``) or in the corpus runner (``prepare``, ``cleanup``); they import what they need
(torch, ctypes) inside, so that listing and scoring the corpus stays torch-free.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from trainwatch.errors import ConfigError

CASES_PACKAGE = "trainwatch.drill.corpus.cases"
CASE_ENV = "TRAINWATCH_CORPUS_CASE"        # the kind the corpus job injects
WORKDIR_ENV = "TRAINWATCH_CORPUS_WORKDIR"  # a folder the case's hooks share (FIFOs, files)
PHASES = ("data", "forward", "allreduce", "metrics")


@dataclass
class Context:
    """What a hook inside a rank sees, and may change for the rest of the run."""

    rank: int
    world_size: int
    fault_rank: int
    fault_step: int
    workdir: Path
    step: int = -1
    side_group: Any = None        # a second gloo group of every rank (for side collectives)
    extra_seconds: float = 0.0    # added to the faulty rank's forward from now on
    loss_scale: float = 1.0       # the loss this rank records is multiplied by it

    @property
    def faulty(self) -> bool:
        return self.rank == self.fault_rank


@dataclass(frozen=True)
class Expect:
    """The right answer: diagnose's first finding has ``category`` (one of them), names
    exactly ``ranks`` (empty: a node-wide cause, no rank) and mentions every ``cause``
    keyword (case-insensitive) in its title, evidence or cause. ``nodes`` (indexes of a
    multi-node case's nodes): a node-level fault's culprit, which the finding must name
    exactly, as it names no rank."""

    category: tuple[str, ...]
    ranks: tuple[int, ...]
    cause: tuple[str, ...]
    nodes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Case:
    kind: str
    simulates: str
    expect: Expect | None           # None: a clean run, where every finding is a false one
    fault: Callable[[Context], None] | None = None  # the faulty rank, at the fault step
    phase: str = "forward"          # where in the step ``fault`` runs
    every_step: Callable[[Context], None] | None = None  # every rank, every step ("metrics")
    item: Callable[[Context, int], None] | None = None   # the dataset's __getitem__ (workers)
    prepare: Callable[[Path], dict[str, str]] | None = None  # runner side: env for the job
    at_fault: Callable[[Path], None] | None = None  # runner side, once the fault is seen
    cleanup: Callable[[Path], None] | None = None
    fault_step: int = 8
    fault_rank: int = 1
    nproc: int = 2                  # ranks per node
    nnodes: int = 1                 # 2: two network namespaces (drill/corpus/launch.py)
    data_workers: int = 0
    abort_on_error: bool = False    # an uncaught error aborts the rank, as NCCL's watchdog does
    ends_job: bool = False          # the fault ends the job: diagnose reads a post-mortem
    launcher_args: tuple[str, ...] = ()
    step_seconds: float = 0.05
    notes: str = ""
    needs: tuple[str, ...] = field(default_factory=tuple)  # what the host must allow (root)

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    def to_json(self) -> dict[str, Any]:
        expect = None if self.expect is None else {
            "category": list(self.expect.category), "ranks": list(self.expect.ranks),
            "cause": list(self.expect.cause), "nodes": list(self.expect.nodes)}
        return {"kind": self.kind, "simulates": self.simulates, "expect": expect,
                "fault_rank": self.fault_rank if self.expect else None,
                "fault_step": self.fault_step, "phase": self.phase, "nproc": self.nproc,
                "nnodes": self.nnodes, "ends_job": self.ends_job, "notes": self.notes,
                "needs": list(self.needs)}


def unmet_needs(case: Case) -> str | None:
    """Why this host cannot run ``case`` (its ``needs``), or None when it can."""
    if "root" in case.needs and os.geteuid() != 0:
        return f"needs root ({', '.join(case.needs)})"
    if case.nnodes > 1:
        from trainwatch.drill import netns
        return netns.unavailable()
    return None


def kinds() -> list[str]:
    """Every kind of the corpus, by its module's name, sorted (clean first)."""
    import trainwatch.drill.corpus.cases as package
    names = sorted(m.name for m in pkgutil.iter_modules(package.__path__)
                   if not m.name.startswith("_"))
    return sorted(names, key=lambda n: n != "clean")


def load(kind: str) -> Case:
    """The case of ``kind``; an unknown kind is bad usage (exit 2)."""
    if kind not in kinds():
        raise ConfigError(f"unknown corpus kind {kind!r} (known: {', '.join(kinds())})",
                          key="KIND")
    case = importlib.import_module(f"{CASES_PACKAGE}.{kind}").CASE
    if case.kind != kind or case.phase not in PHASES:
        raise ConfigError(f"corpus case {kind}: kind {case.kind!r} must be its module's "
                          f"name and phase one of {', '.join(PHASES)} (got {case.phase!r})")
    return case


def load_all() -> list[Case]:
    return [load(k) for k in kinds()]
