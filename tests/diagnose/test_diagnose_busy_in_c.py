"""A rank busy in C holding the GIL (a catastrophic regular expression: 100 % CPU, its
telemetry thread cannot beat) is busy, not frozen: to the node agent and to `trainwatch
diagnose`, on one real torchrun job that both look at. Its own file: the job burns a CPU
until the module's fixture ends it, which is the end of the module."""

import time

import pytest

from agent_helpers import get_json, http_get, start_agent, stop_process, wait_for
from diagnose_helpers import Job, no_confident_wrong, stalled_for, timed_diagnose, top

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def busy_in_regex(tmp_path_factory):
    """One job whose rank 1 backtracks in a regular expression from step 10 (busy in C, the
    GIL held, for longer than any test waits), watched by a node agent from its start: the
    agent's verdict and diagnose's are on the same rank of the same job. (job, agent URL)"""
    tmp = tmp_path_factory.mktemp("regex")
    job = Job(tmp, FAULT="regex", FAULT_RANK="1", FAULT_STEP="10")
    try:
        agent, url = start_agent(tmp, "--run-dir", str(job.run.root))
        try:
            yield job, url
        finally:
            stop_process(agent)
    finally:
        job.stop()


def test_agent_calls_a_rank_busy_in_c_busy_not_frozen(busy_in_regex):
    """The node agent says what diagnose says: rank 1 backtracking in a regular expression
    (the GIL held, its heartbeat stale) is busy (R, CPU used), in its finding, the stall
    incident and the metrics; at no moment frozen (its frozen count, kept since the job
    started, is 0). Before diagnose's look at the same job: py-spy stops a rank it dumps."""
    _, url = busy_in_regex
    kinds: list[str] = []

    def busy():
        found = [f for f in get_json(url + "/status")["findings"] if f.get("rank") == 1]
        kinds.extend(f["stall_kind"] for f in found)
        return next((f for f in found if f["stall_kind"] == "busy"), None)
    finding = wait_for(busy, 90, interval=0.3, what="the agent's busy finding for rank 1")
    incident = next(f for f in get_json(url + "/status")["findings"]
                    if f["kind"] == "stall_incident")
    metrics = http_get(url + "/metrics").decode()
    assert "frozen" not in kinds, kinds
    assert finding["message"].startswith("rank 1 busy (R, "), finding["message"]
    assert "% CPU" in finding["message"] and "heartbeat" in finding["message"], finding
    assert incident["culprit_ranks"] == [1] and incident["stall_kind"] == "busy", incident
    info = [line for line in metrics.splitlines()
            if line.startswith("trainwatch_rank_stall_info{") and 'rank="1"' in line]
    assert len(info) == 1 and 'kind="busy"' in info[0], info
    frozen = [line for line in metrics.splitlines()
              if line.startswith("trainwatch_rank_stalls_total{") and 'rank="1"' in line
              and 'kind="frozen"' in line]
    assert frozen and float(frozen[0].split()[-1]) == 0, frozen
    print(finding["message"])


def test_rank_busy_in_c_holding_the_gil_is_busy_not_frozen(busy_in_regex):
    """Rank 1 backtracks in a regular expression: 100 % CPU, the GIL held (its telemetry
    thread cannot beat). Busy is not frozen: the function is named from its stack, and no
    advice to set what the job already set."""
    job, _ = busy_in_regex
    job.wait(lambda s: s[0]["step"] == 10 and time.time() - s[1]["heartbeat_at"] > 3
             and stalled_for(3)(s), "rank 1 busy in the regex, its heartbeat stale")
    code, report, _ = timed_diagnose(job.run, "--stall-after", "2")
    assert code == 1
    finding = top(report)
    assert finding["category"] == "rank_stuck" and finding["ranks"] == [1], finding
    assert "busy" in finding["title"] and "frozen" not in finding["title"], finding["title"]
    assert "re.match" in finding["title"], finding["title"]
    assert "busy_in_regex" in " ".join(finding["evidence"]), finding["evidence"]
    assert any("GIL" in e for e in finding["evidence"]), finding["evidence"]
    assert any("CPU" in e for e in finding["evidence"]), finding["evidence"]
    assert "TORCH_FR_BUFFER_SIZE" not in " ".join(
        f["next_command"] or "" for f in report["findings"]), report["findings"]
    no_confident_wrong(report, 1)
