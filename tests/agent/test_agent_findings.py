"""Findings are conditions: they appear with evidence, keep their identity while they
last, clear by themselves and are remembered as recently cleared."""

import os
import time

from agent_helpers import collector, make_ctx, publish
from trainwatch.agent.registry import Result
from trainwatch.contract.timing import job_window, summarize


def ranks_data(now, *, progress_age, heartbeat_age=0.1, status="sleeping", timing=None):
    rank = {"rank": 1, "local_rank": 1, "pid": 4242, "state": "running", "step": 50,
            "phase": "backward", "phase_since": now - progress_age,
            "last_progress_at": now - progress_age, "heartbeat_at": now - heartbeat_age,
            "started_at": now - 600, "metrics": {"step": 49, "step_time_seconds": 0.1},
            "progress_age": progress_age, "heartbeat_age": heartbeat_age,
            "phase_age": progress_age,
            "process": {"status": status}}
    return Result(data={"observed_mono": time.monotonic(),
                        "jobs": [{"job": "exp", "run_dir": "/r", "ranks": [rank],
                                  "timing": timing, "env": {}}]})


def job_of(now, ranks, job="exp"):
    """Several ranks of one job: (rank, step, phase, progress_age, heartbeat_age, status)."""
    views = [{"rank": r, "local_rank": r, "pid": 4000 + r, "state": "running", "step": step,
              "phase": phase, "phase_since": now - age, "last_progress_at": now - age,
              "heartbeat_at": now - hb, "started_at": now - 600,
              "metrics": {"step": step - 1, "step_time_seconds": 0.1},
              "progress_age": age, "heartbeat_age": hb, "phase_age": age,
              "process": {"status": status}} for r, step, phase, age, hb, status in ranks]
    return Result(data={"observed_mono": time.monotonic(),
                        "jobs": [{"job": job, "run_dir": "/r", "ranks": views, "timing": None,
                                  "env": {}}]})


def incident_samples(result):
    seconds = [s for s in result.every_sample() if s.name == "trainwatch_stall_incident_seconds"]
    roles = {s.labels["role"]: s.value for s in result.every_sample()
             if s.name == "trainwatch_stall_incident_ranks"}
    return seconds, roles


def test_a_4_rank_stall_is_one_incident_naming_the_culprit():
    ctx = make_ctx()
    findings = collector(ctx, "findings")
    now = time.time()
    # rank 2 SIGSTOPped in forward; the others wait in the all-reduce (backward)
    publish(ctx, "ranks", job_of(now, [(0, 50, "backward", 8.0, 0.1, "sleeping"),
                                       (1, 50, "backward", 8.0, 0.1, "sleeping"),
                                       (2, 50, "forward", 8.2, 8.2, "stopped"),
                                       (3, 50, "backward", 7.9, 0.1, "sleeping")]))
    result = findings.collect()
    by_id = {f["id"]: f for f in result.data["findings"]}
    incident = by_id["stall_incident/exp"]
    assert incident["culprit_ranks"] == [2] and incident["waiting_ranks"] == [0, 1, 3]
    assert incident["stall_kind"] == "frozen" and incident["severity"] == "critical"
    assert [f["rank"] for f in by_id.values() if f["severity"] == "critical"
            and f["kind"] == "stall"] == [2]
    assert all(by_id[f"stall/exp/{r}"]["role"] == "waiting" for r in (0, 1, 3))
    (seconds,), roles = incident_samples(result)
    assert seconds.labels["culprit_rank"] == "2" and seconds.labels["kind"] == "frozen"
    assert 8.0 <= seconds.value < 9.0 and roles == {"culprit": 1, "waiting": 3}
    # a stuck rank outside the collective the others wait in (a FIFO in data loading)
    publish(ctx, "ranks", job_of(now, [(0, 50, "backward", 8.0, 0.1, "sleeping"),
                                       (1, 50, "data", 8.2, 0.1, "sleeping")]))
    (seconds,), roles = incident_samples(findings.collect())
    assert seconds.labels["culprit_rank"] == "1" and seconds.labels["kind"] == "stuck"
    # a node whose stalled ranks all wait alike names no culprit
    publish(ctx, "ranks", job_of(now, [(4, 50, "backward", 8.0, 0.1, "sleeping"),
                                       (5, 50, "backward", 8.0, 0.1, "sleeping")]))
    (seconds,), roles = incident_samples(findings.collect())
    assert seconds.labels["culprit_rank"] == "unknown" and roles == {"culprit": 0, "waiting": 2}
    # progress again: no incident series, counts back to 0
    publish(ctx, "ranks", job_of(now, [(4, 51, "forward", 0.1, 0.1, "sleeping")]))
    seconds, roles = incident_samples(findings.collect())
    assert seconds == [] and roles == {"culprit": 0, "waiting": 0}


def test_a_rank_busy_with_a_silent_heartbeat_is_the_busy_culprit():
    """Rank 2 burns a core in C holding the GIL (its heartbeat stale), the others wait in
    the all-reduce: the culprit is busy, named so in its finding, the incident and the
    metrics, and never frozen."""
    ctx = make_ctx()
    findings = collector(ctx, "findings")
    now = time.time()
    result = job_of(now, [(0, 50, "backward", 8.0, 0.1, "sleeping"),
                          (1, 50, "backward", 8.0, 0.1, "sleeping"),
                          (2, 50, "forward", 8.2, 8.2, "running")])
    result.data["jobs"][0]["ranks"][2]["process"].update(cpu_cores=0.98, main_runnable=1.0)
    publish(ctx, "ranks", result)
    judged = findings.collect()
    by_id = {f["id"]: f for f in judged.data["findings"]}
    incident, culprit = by_id["stall_incident/exp"], by_id["stall/exp/2"]
    assert incident["culprit_ranks"] == [2] and incident["stall_kind"] == "busy", incident
    assert incident["reason"] == "busy while the others wait"
    assert culprit["stall_kind"] == "busy" and culprit["role"] == "culprit"
    assert culprit["message"].startswith("rank 2 busy (R, 98 % CPU, main thread runnable "
                                         "100 %, heartbeat 8.2 s old) in phase forward")
    assert "trainwatch diagnose names the function" in culprit["message"]
    assert "frozen" not in str(by_id)
    (seconds,), _ = incident_samples(judged)
    assert seconds.labels["kind"] == "busy"
    kinds = {s.labels["kind"] for s in judged.every_sample()
             if s.name == "trainwatch_rank_stall_info"}
    assert kinds == {"busy", "stuck"}
    counted = {s.labels["kind"]: s.value for s in judged.every_sample()
               if s.name == "trainwatch_rank_stalls_total" and s.labels["rank"] == "2"}
    assert counted == {"stuck": 0, "busy": 1, "frozen": 0, "dead": 0}


def stall_metric(result, name):
    return [s.value for s in result.every_sample() if s.name == name][0]


def test_stall_finding_lifecycle():
    ctx = make_ctx()
    findings = collector(ctx, "findings")
    now = time.time()
    publish(ctx, "ranks", ranks_data(now, progress_age=1.0))
    assert findings.collect().data["findings"] == []
    publish(ctx, "ranks", ranks_data(now, progress_age=8.0, heartbeat_age=8.0, status="stopped"))
    first = findings.collect()
    finding, incident = first.data["findings"]
    assert finding["id"] == "stall/exp/1" and finding["stall_kind"] == "frozen"
    assert finding["role"] == "culprit" and incident["culprit_rank"] == 1
    assert finding["phase"] == "backward" and abs(finding["since"] - (now - 8.0)) < 1
    assert stall_metric(first, "trainwatch_rank_stalled") == 1
    info = [s for s in first.every_sample() if s.name == "trainwatch_rank_stall_info"][0]
    assert info.labels["kind"] == "frozen" and info.labels["phase"] == "backward"
    again = findings.collect()
    assert again.data["findings"][0]["detected_at"] == finding["detected_at"]
    publish(ctx, "ranks", ranks_data(time.time(), progress_age=0.1))
    cleared = findings.collect()
    assert cleared.data["findings"] == []
    assert stall_metric(cleared, "trainwatch_rank_stalled") == 0
    assert cleared.data["recently_cleared"][0]["id"] == "stall/exp/1"
    total = [s for s in cleared.every_sample() if s.name == "trainwatch_rank_stalls_total"
             and s.labels["kind"] == "frozen"][0]
    assert total.value == 1


def slow_rank_windows(ctx, findings, now):
    """Rank 1 at 1.3x the job's median for 8 windows of 5 steps (rank 0 is on another
    node): each poll's result, and the last window's timing."""
    for step in range(5, 45, 5):
        # what the ranks collector makes of rank 1's status
        timing = job_window({1: {"step": step, "window_steps": 5, "time": now + step,
                                 "compute_seconds": 0.13, "data_wait_seconds": 0.0,
                                 "local_seconds": 0.13, "job": summarize([0.1, 0.13])}})
        publish(ctx, "ranks", ranks_data(now, progress_age=0.1, timing=timing))
        yield findings.collect(), timing


def test_straggler_finding_from_published_timing():
    ctx = make_ctx()
    findings = collector(ctx, "findings")
    *_, (result, _timing) = slow_rank_windows(ctx, findings, time.time())
    by_kind = {f["kind"]: f for f in result.data["findings"]}
    assert set(by_kind) == {"straggler", "node_straggler"}  # rank 0 lives on another node
    finding = by_kind["straggler"]
    assert finding["rank"] == 1 and abs(by_kind["node_straggler"]["ratio"] - 1.3) < 1e-6
    assert finding["since_step"] == 1 and finding["detected_step"] == 40  # 8 windows
    assert finding["cause"] == "unknown" and abs(finding["ratio"] - 1.3) < 1e-6
    ratio = [s.value for s in result.every_sample() if s.name == "trainwatch_straggler_time_ratio"][0]
    assert abs(ratio - 1.3) < 1e-9


def test_a_rank_that_ended_leaves_no_straggler_ratio_behind():
    """A job stopped cleanly (CI saw it: TrainingStragglerRank pending for the stopped run B
    of the shipped deployment): its ranks' last ratio, skewed as the ranks ended one after
    the other, must not stand after they ended, nor their straggler finding."""
    ctx = make_ctx()
    findings = collector(ctx, "findings")
    now = time.time()
    polls = list(slow_rank_windows(ctx, findings, now))
    assert all(result.data["ranks"]["exp/1"]["straggler"] is not None for result, _ in polls)
    timing = polls[-1][1]
    for state in ("stopped", "finished"):
        ended = ranks_data(now, progress_age=0.1, timing=timing)
        ended.data["jobs"][0]["ranks"][0]["state"] = state
        publish(ctx, "ranks", ended)
        result = findings.collect()
        names = {s.name for s in result.every_sample()}
        assert "trainwatch_straggler_time_ratio" not in names, state
        assert [f for f in result.data["findings"] if f["kind"] == "straggler"] == [], state
        assert result.data["ranks"]["exp/1"]["straggler"] is None, state


def test_old_observations_are_not_judged_and_no_counter_moves():
    """After a pause the ranks data is old: the findings keep their last verdicts (here:
    none) instead of calling every rank frozen from a stale snapshot."""
    ctx = make_ctx()
    findings = collector(ctx, "findings")
    now = time.time()
    publish(ctx, "ranks", ranks_data(now, progress_age=0.5))
    assert findings.collect().data["findings"] == []
    stale = ranks_data(now, progress_age=60.0, heartbeat_age=60.0)
    stale.data["observed_mono"] = time.monotonic() - 60  # observed before a 60 s pause
    publish(ctx, "ranks", stale)
    result = findings.collect()
    assert result.data["findings"] == [] and "re-observing" in result.reason
    assert sum(s.value for s in result.every_sample() if s.name == "trainwatch_rank_stalls_total") == 0
    resync = ranks_data(now, progress_age=60.0, heartbeat_age=60.0)
    resync.data["judge_after_mono"] = time.monotonic() + 5  # the ranks collector saw a gap
    publish(ctx, "ranks", resync)
    assert findings.collect().data["findings"] == []
    publish(ctx, "ranks", ranks_data(now, progress_age=60.0, heartbeat_age=60.0))
    assert findings.collect().data["findings"][0]["stall_kind"] == "frozen"


def test_incident_names_what_a_stuck_culprit_waits_on_from_the_kernel(tmp_path):
    """The culprit blocks in flock on a file another process holds: the incident says so."""
    import fcntl
    import subprocess
    import sys
    lock = open(tmp_path / "held.lock", "a")
    fcntl.flock(lock, fcntl.LOCK_EX)  # this test process is the holder
    child = subprocess.Popen([sys.executable, "-c", "import fcntl, sys; "
                              "fcntl.flock(open(sys.argv[1], 'a'), fcntl.LOCK_EX)",
                              str(tmp_path / "held.lock")])
    try:
        from trainwatch.host.procinfo import main_thread_wait, thread_waits
        # Wait for the flock itself: starting Python, the child also waits on file reads.
        deadline = time.time() + 60
        while (main_thread_wait(child.pid) or {}).get("kind") != "file_lock" \
                and time.time() < deadline:
            assert child.poll() is None, f"the child exited ({child.returncode})"
            time.sleep(0.05)
        assert main_thread_wait(child.pid) is not None, thread_waits(child.pid)
        ctx = make_ctx()
        findings = collector(ctx, "findings")
        now = time.time()
        data = job_of(now, [(0, 50, "backward", 8.0, 0.1, "sleeping"),
                            (1, 50, "data", 8.2, 0.1, "sleeping")])
        data.data["jobs"][0]["ranks"][1]["pid"] = child.pid
        publish(ctx, "ranks", data)
        incident = next(f for f in findings.collect().data["findings"]
                        if f["kind"] == "stall_incident")
        assert incident["culprit_ranks"] == [1] and incident["cause"]["kind"] == "file_lock"
        assert incident["cause"]["holder"]["pid"] == os.getpid(), incident["cause"]
        assert f"held by pid {os.getpid()}" in incident["message"], incident["message"]
    finally:
        child.kill()
        child.wait()
        lock.close()


def test_a_node_whose_ranks_all_freeze_is_one_node_level_incident():
    ctx = make_ctx()
    findings = collector(ctx, "findings")
    now = time.time()
    publish(ctx, "ranks", job_of(now, [(r, 50, "checkpoint", 9.0 + r, 9.0, "disk_sleep")
                                       for r in range(8, 16)]))
    result = findings.collect()
    (incident,) = [f for f in result.data["findings"] if f["kind"] == "stall_incident"]
    assert sorted(incident["culprit_ranks"]) == list(range(8, 16))
    assert incident["culprit_rank"] == 15  # the first to stop
    assert "node-level" in incident["reason"] and incident["waiting_ranks"] == []
    (seconds,), roles = incident_samples(result)
    assert roles == {"culprit": 8, "waiting": 0}  # one alert for the node, not eight


def test_a_rank_a_step_ahead_of_ranks_waiting_in_a_collective_is_the_culprit():
    """Rank 1 skipped a side group's all_reduce: it waits in the next step's collective
    while ranks 0 and 2 wait in the one it skipped. The odd one out is named, not the ranks
    behind; two equal sides name no one."""
    ctx = make_ctx()
    findings = collector(ctx, "findings")
    now = time.time()
    publish(ctx, "ranks", job_of(now, [(0, 12, "allreduce", 8.0, 0.1, "sleeping"),
                                       (1, 13, "allreduce", 8.1, 0.1, "sleeping"),
                                       (2, 12, "allreduce", 8.0, 0.1, "sleeping")]))
    (incident,) = [f for f in findings.collect().data["findings"]
                   if f["kind"] == "stall_incident"]
    assert incident["culprit_ranks"] == [1] and incident["waiting_ranks"] == [0, 2], incident
    assert "out of step" in incident["message"] + str(incident.get("evidence")), incident
    ctx = make_ctx()
    findings = collector(ctx, "findings")
    publish(ctx, "ranks", job_of(now, [(0, 12, "allreduce", 8.0, 0.1, "sleeping"),
                                       (1, 13, "allreduce", 8.1, 0.1, "sleeping")]))
    (incident,) = [f for f in findings.collect().data["findings"]
                   if f["kind"] == "stall_incident"]
    assert incident["culprit_ranks"] == [], incident


def test_a_flagged_straggler_stays_flagged_while_its_newest_window_is_not_in():
    """The slow rank is the last to publish each new window: at a poll in between, the
    job's newest window lacks it. Its flag must not blink off there (the e2e saw the flag
    in only 9 of 12 polls while rank 2 was slow)."""
    ctx = make_ctx()
    findings = collector(ctx, "findings")
    now = time.time()
    local = [0.05, 0.05, 0.0625, 0.05]  # rank 2 at 0.8x speed

    def poll(step, published):
        result = job_of(now, [(r, step, "forward", 0.05, 0.1, "sleeping") for r in range(4)])
        result.data["jobs"][0]["timing"] = job_window({r: {
            "step": step, "window_steps": 5, "time": float(step), "compute_seconds": local[r],
            "data_wait_seconds": 0.0, "local_seconds": local[r], "job": summarize(local)}
            for r in published})
        publish(ctx, "ranks", result)
        return {f["rank"] for f in findings.collect().data["findings"]
                if f["kind"] == "straggler"}

    for step in range(4, 44, 5):
        flagged = poll(step, range(4))
    assert flagged == {2}
    assert poll(44, [0, 1, 3]) == {2}  # rank 2 has not published window 44 yet
    assert poll(44, range(4)) == {2}


def test_a_run_its_supervisor_stopped_raises_no_finding():
    """`trainwatch run` stopped on purpose (Ctrl-C, systemctl stop): its ranks are gone, but
    nobody is to be told "dead" in /status, as no alert pages for it either."""
    ctx = make_ctx()
    findings = collector(ctx, "findings")
    now = time.time()
    publish(ctx, "journal", Result(data={"/r": {"job": "exp", "supervisor_stopped": True}}))
    publish(ctx, "ranks", ranks_data(now, progress_age=8.0, heartbeat_age=8.0, status="gone"))
    assert findings.collect().data["findings"] == []
    publish(ctx, "journal", Result(data={"/r": {"job": "exp", "supervisor_stopped": False}}))
    finding, _incident = findings.collect().data["findings"]
    assert finding["id"] == "stall/exp/1" and finding["stall_kind"] == "dead"
