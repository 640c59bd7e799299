"""Instruction counts of labelled blocks of a benchmark's own run under callgrind.

Callgrind dumps the counts gathered since its last dump when the program asks it to;
Python cannot issue that client request itself, so a two-line C library does: the
benchmark runs itself again under valgrind with ``--count-child SHIM`` and calls the
shim's ``trainwatch_dump(label)`` after each block (telemetry_overhead.py,
loop_instructions.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

_DUMP_SHIM = """#include <valgrind/callgrind.h>
void trainwatch_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
"""


def counts_under_callgrind(script: str, child_args: list[str]) -> dict[str, int]:
    """Run ``script --count-child SHIM *child_args`` under callgrind (one intra-op
    thread); each dump's instruction total, by its label."""
    work = tempfile.mkdtemp(prefix="trainwatch-callgrind-")
    try:
        source, shim = os.path.join(work, "dump.c"), os.path.join(work, "dump.so")
        with open(source, "w") as f:
            f.write(_DUMP_SHIM)
        subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", shim, source], check=True)
        out = os.path.join(work, "callgrind.out")
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                        sys.executable, os.path.abspath(script), "--count-child", shim,
                        *child_args],
                       check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return _counts(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _counts(work: str) -> dict[str, int]:
    """Each dump's total, by its label."""
    counts: dict[str, int] = {}
    trigger = "desc: Trigger: Client Request: "
    for name in os.listdir(work):
        if not name.startswith("callgrind.out."):
            continue
        label, total = "", 0
        with open(os.path.join(work, name)) as f:
            for line in f:
                if line.startswith(trigger):
                    label = line[len(trigger):].strip()
                elif line.startswith(("summary:", "totals:")):
                    total = int(line.split()[1])
        counts[label] = total
    return counts
