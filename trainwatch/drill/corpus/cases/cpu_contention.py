"""Every core of the node is contended by processes outside the job, from the fault step on.

The job here does CPU work every step (as a job that decodes or augments its data on the
CPU does): a job that only sleeps and waits keeps its pace on a contended node, and
nothing is wrong with it. The hogs start when the runner sees the fault step, in their own
sessions (not in the job's process tree), four per core.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

from trainwatch.drill.corpus.case import Case, Context, Expect

HOGS_PER_CORE = 4
WORK_ITERATIONS = 150_000  # a few tens of ms of pure-Python CPU work a step

_HOGS: dict[str, list[subprocess.Popen]] = {}


def mark(ctx: Context) -> None:
    """Detection counts from here; the runner starts the hogs when it sees this step."""


def cpu_work(ctx: Context) -> None:
    total = 0
    for i in range(WORK_ITERATIONS):
        total += i * i
    ctx.loss_scale = 1.0 + 0 * total


def start_hogs(work: Path) -> None:
    n = HOGS_PER_CORE * (os.cpu_count() or 1)
    _HOGS[str(work)] = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                         start_new_session=True) for _ in range(n)]


def stop_hogs(work: Path) -> None:
    for hog in _HOGS.pop(str(work), []):
        hog.send_signal(signal.SIGKILL)
        hog.wait()


CASE = Case(
    kind="cpu_contention",
    simulates="node-level CPU contention: other processes take the node's cores (another "
              "job, a runaway data preprocessor); every rank of a job that needs the CPU "
              "slows down together",
    expect=Expect(category=("node",), ranks=(), cause=("cpu-contended",)),
    fault=mark, every_step=cpu_work, at_fault=start_hogs, cleanup=stop_hogs, fault_step=60)
