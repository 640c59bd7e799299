"""Every core of the node is contended by processes outside the job."""

import os
import signal
import subprocess
import sys
from pathlib import Path

from trainwatch.drill.corpus.case import Case, Context, Expect

_HOGS: dict[str, list[subprocess.Popen]] = {}


def mark(ctx: Context) -> None:
    """The contention starts with the run (prepare); the fault step only marks the time
    from which detection counts, once the hogs have had the node for a while."""


def start_hogs(work: Path) -> dict[str, str]:
    n = 2 * (os.cpu_count() or 1)
    _HOGS[str(work)] = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                         start_new_session=True) for _ in range(n)]
    return {}


def stop_hogs(work: Path) -> None:
    for hog in _HOGS.pop(str(work), []):
        hog.send_signal(signal.SIGKILL)
        hog.wait()


CASE = Case(
    kind="cpu_contention",
    simulates="node-level CPU contention: other processes take the node's cores (another "
              "job, a runaway data preprocessor); every rank slows down",
    expect=Expect(category=("node",), ranks=(), cause=("cpu",)),
    fault=mark, prepare=start_hogs, cleanup=stop_hogs, fault_step=30)
