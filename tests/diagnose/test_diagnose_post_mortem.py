"""The post-mortem of a hang the deaths ended reads the evidence the run directory kept
(issue #36, item 2): the ranks' dumps in diagnostics/ and the controller's stall folder,
says which it used and which it could not, and is never surer than that evidence.

The case of the issue, recorded as the ranks and diagnose write it (no processes): 3 ranks,
rank 1 skipped an all_reduce on a side group inside the job's own phase "metrics" and went
on to the next gradient all_reduce; ranks 0 and 2 waited in the side group's. A live
diagnose had dumped every rank; then the job was killed.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from trainwatch.diagnose import analysis
from trainwatch.diagnose.gather import Options, gather
from trainwatch.rundir.atomic import atomic_write_json
from trainwatch.rundir.run_dir import RunDir

STEP = 12


def _gone_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _entry(group: str, seq: int, op: str = "all_reduce") -> dict:
    return {"pg_id": int(group), "process_group": [group, "side" if group == "1" else
                                                   "default_pg"],
            "collective_seq_id": seq, "profiling_name": f"gloo:{op}", "input_sizes": [[4]],
            "input_dtypes": ["Float"], "time_created_ns": seq * 10**9, "is_p2p": False,
            "frames": [{"file": "job.py", "line": 90, "function": "main"}]}


def _trace(default: tuple[int, int], side: tuple[int, int]) -> dict:
    """A gloo flight-recorder trace: (enqueued, completed) per group."""
    entries = [_entry("0", s) for s in range(1, default[0] + 1)]
    entries += [_entry("1", s) for s in range(1, side[0] + 1)]
    return {"version": "2.4", "entries": entries, "pg_status": {
        "0": {"last_enqueued_collective": default[0], "last_completed_collective": default[1]},
        "1": {"last_enqueued_collective": side[0], "last_completed_collective": side[1]}}}


def killed_hang(tmp_path, dumps: bool) -> tuple[RunDir, dict[int, int]]:
    now = time.time()
    run = RunDir(tmp_path / "run").create()
    run.write_run_info({"job": "exp", "world_size": 3})
    pids = {r: _gone_pid() for r in range(3)}
    progress, died = now - 40, now - 5
    for rank in range(3):
        skipped = rank == 1
        run.write_status(rank, {
            "job": "exp", "rank": rank, "local_rank": rank, "world_size": 3,
            "node": socket.gethostname(), "pid": pids[rank], "backend": "gloo",
            "started_at": now - 60, "heartbeat_at": died, "heartbeat_interval": 0.2,
            "step": STEP + 1 if skipped else STEP, "phase": "backward" if skipped else "metrics",
            "phase_since": progress, "last_progress_at": progress, "state": "running",
            "metrics": {"step": STEP, "step_time_seconds": 0.05}})
        if dumps:  # a live diagnose's control/dump, answered while they hung
            trace = (_trace((STEP + 1, STEP), (STEP - 1, STEP - 1)) if skipped else
                     _trace((STEP, STEP), (STEP, STEP - 1)))
            atomic_write_json(run.dump_file(rank), {
                "format": "trainwatch.dump", "version": 1, "rank": rank, "pid": pids[rank],
                "time": now - 20, "request": "r1", "step": STEP, "phase": "metrics",
                "threads": [{"thread_id": 1, "name": "MainThread", "frames": [
                    {"file": "job.py", "line": 90 if skipped else 80, "function": "main"},
                    {"file": "torch/distributed/c10d.py", "line": 7, "function": "wait"}]}],
                "flight_recorder": trace})
    stall = run.diagnostics_dir / "stall-20261206T031500"
    stall.mkdir(parents=True)
    (stall / "dump-rank-00002.json").write_text("{not json")  # torn by a full disk
    (stall / "py-spy-rank-00000.txt").write_text(
        "Process 4242: python job.py\nPython v3.12\n\nThread 4242 (idle): \"MainThread\"\n"
        "    main (job.py:80)\n")  # an earlier attempt's process
    return run, pids


def post_mortem(run: RunDir) -> dict:
    ev = gather(run, Options(request_dumps=False, timeout=2))
    return next(f for f in analysis.analyse(ev, 5.0) if f.category == "rank_stuck").to_dict()


def test_the_dumps_left_in_diagnostics_name_the_rank_that_skipped_the_collective(tmp_path):
    """Before: "stalled ... before it died: rank(s) [0, 2] were outside a collective while the
    others waited in one" (medium), from the phases, the dumps naming rank 1 unread."""
    run, _ = killed_hang(tmp_path, dumps=True)
    finding = post_mortem(run)
    assert finding["ranks"] == [1] and finding["confidence"] == "high", finding
    assert finding["title"].endswith(
        f"before it died: rank(s) [1] did not enter collective #{STEP} of process group 1, "
        "which rank(s) [0, 2] waited in"), finding["title"]
    text = "\n".join(finding["evidence"])
    assert (f"process group 0: rank(s) [1] waited in collective #{STEP + 1} "
            "gloo:all_reduce") in text, text
    assert ("saved evidence used: diagnostics/dump-rank-00000.json, "
            "diagnostics/dump-rank-00001.json, diagnostics/dump-rank-00002.json") in text, text
    assert "saved evidence unreadable: diagnostics/stall-20261206T031500/dump-rank-00002.json" \
        in text, text
    assert ("saved evidence not used: diagnostics/stall-20261206T031500/py-spy-rank-00000.txt: "
            "of pid 4242, not rank 0's last process") in text, text
    assert finding["stack"][-1].endswith("in wait") and "job.py:90" in finding["stack"][0]


def test_without_saved_dumps_a_job_s_own_phase_gives_low_confidence(tmp_path):
    """From phases alone a rank in the job's own phase may be the one waiting (a side
    group's collective in it): low confidence, and the finding says it had no dumps."""
    run, _ = killed_hang(tmp_path, dumps=False)
    finding = post_mortem(run)
    assert finding["ranks"] == [0, 2] and finding["confidence"] == "low", finding
    assert "who waited for whom is not certain" in finding["title"], finding["title"]
    text = "\n".join(finding["evidence"])
    assert "phase(s) metrics are the job's own: one may hold a collective" in text, text
    assert "saved evidence used: none" in text, text
