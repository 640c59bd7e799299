"""Rank 1 allocates until the kernel's OOM killer kills it, in a 256 MiB memory cgroup."""

import os
import time
from pathlib import Path

from trainwatch.drill.corpus.case import Case, Context, Expect

LIMIT = 256 << 20


def make_cgroup(work: Path) -> dict[str, str]:
    """A memory cgroup beside the runner's own (cgroup v2 or v1), limited to 256 MiB."""
    from trainwatch.host.cgroup import cgroup_dir, memory_cgroup
    own = memory_cgroup("self")
    base = cgroup_dir(own) if own else None
    if not base:
        raise RuntimeError("no memory cgroup on this host (/proc/self/cgroup)")
    folder = Path(base) / f"trainwatch-corpus-oom-{os.getpid()}-{time.time_ns()}"
    folder.mkdir()
    v1 = own is not None and own.startswith("v1")
    (folder / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(str(LIMIT))
    (work / "oom-cgroup").write_text(str(folder))
    return {}


def remove_cgroup(work: Path) -> None:
    marker = work / "oom-cgroup"
    if not marker.exists():
        return
    folder = Path(marker.read_text())
    deadline = time.time() + 30
    while folder.exists():
        try:
            folder.rmdir()
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.5)


def allocate(ctx: Context) -> None:
    folder = Path((ctx.workdir / "oom-cgroup").read_text())
    (folder / "cgroup.procs").write_text(str(os.getpid()))
    hog = []
    while True:
        hog.append(b"\x01" * (16 << 20))


CASE = Case(
    kind="oom",
    simulates="a rank killed by the kernel's OOM killer (a memory leak, a batch too big for "
              "its cgroup's limit)",
    expect=Expect(category=("rank_dead",), ranks=(1,), cause=("OOM",)),
    fault=allocate, prepare=make_cgroup, cleanup=remove_cgroup, ends_job=True,
    needs=("root", "cgroups"))
