"""Environment variables trainwatch reads or sets, and the defaults they stand in for."""

from __future__ import annotations

import os

RUN_DIR_ENV = "TRAINWATCH_RUN_DIR"        # the run directory (set for the ranks by the launcher)
JOB_ENV = "TRAINWATCH_JOB"                # the job's name (default: the run directory's name)
NODE_ENV = "TRAINWATCH_NODE"              # this node's name (default: the hostname)
FAULT_ENV = "TRAINWATCH_FAULT"            # a fault to inject (docs/trainer.md)
LAUNCH_ENV = "TRAINWATCH_LAUNCH"          # the controller's launch count (1, 2, ...)
# The id of the supervisor that started a process (its lock record's ``token``), inherited
# by everything under it: a launcher knows it runs under the lock's holder, and the next
# supervisor finds what a killed one left running.
SUPERVISOR_ENV = "TRAINWATCH_SUPERVISOR"
GRAFANA_TOKEN_ENV = "TRAINWATCH_GRAFANA_TOKEN"
RECEIVER_TOKEN_ENV = "TRAINWATCH_RECEIVER_TOKEN"
STORE_ADDR_ENV = "TRAINWATCH_STORE_ADDR"  # torchrun's stores listen here only (trainer/stores.py)
# torchrun's --local-addr (it reads any option as PET_<NAME>): a one-node command's MASTER_ADDR.
TORCHRUN_LOCAL_ADDR_ENV = "PET_LOCAL_ADDR"
REHEARSAL_ENV = "TRAINWATCH_REHEARSAL"    # "1" while `trainwatch rehearse` runs a command
REGENERATE_ENV = "TRAINWATCH_REGENERATE"  # tests: rewrite expected files instead of comparing
# The address a rank's receiver of peer snapshot copies listens on (default: the address of
# the route towards MASTER_ADDR: rank/memory_snapshots/peer_copies.py).
PEER_ADDR_ENV = "TRAINWATCH_PEER_ADDR"

# The run directory of a reading command given none (relative to the working directory).
DEFAULT_RUN_DIR = "trainwatch-run"


def run_dir_from_env(default: str = DEFAULT_RUN_DIR) -> str:
    """``$TRAINWATCH_RUN_DIR``, else ``default``."""
    return os.environ.get(RUN_DIR_ENV) or default
