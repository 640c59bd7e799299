"""Ages are the agent's observations: a wobbling phase start is one phase, a value that
stops changing ages on the monotonic clock, and a new value is never older than the
previous look (a clock jump or a paused agent ages nothing)."""

from __future__ import annotations

import os
import time

from agent_helpers import collector, make_ctx, write_status
from trainwatch.rundir.run_dir import RunDir


def test_phase_age_grows_while_the_start_wobbles_and_new_values_are_clamped(tmp_path):
    run = RunDir(tmp_path / "run").create()
    ranks = collector(make_ctx([run.root]), "ranks")
    start = time.time() - 30
    write_status(run, 0, os.getpid(), phase="eval", phase_since=start)
    first = ranks.collect().data["jobs"][0]["ranks"][0]
    assert 29 < first["phase_age"] < 40
    time.sleep(1.0)
    # the telemetry re-derives phase_since from its clock offset: microseconds apart
    write_status(run, 0, os.getpid(), phase="eval", phase_since=start + 2e-6,
                 heartbeat_at=time.time() + 3600)  # and its wall clock jumped an hour
    second = ranks.collect().data["jobs"][0]["ranks"][0]
    assert second["phase_age"] >= first["phase_age"] + 0.9
    assert second["heartbeat_age"] <= 1.5  # new since the last look: not an hour off
