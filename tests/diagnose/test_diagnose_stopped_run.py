"""`trainwatch diagnose` on a run its user stopped (Ctrl-C on `trainwatch run`) whose job
does not save on SIGTERM (telemetry only, tests/jobs/diagnose_job.py): its ranks die by
the signal with statuses still saying "running". That is the stop the journal records,
not two ranks that died at once: no critical finding, exit 0, the stop named."""

import pytest

from diagnose_helpers import diagnose, stopped_with_ctrl_c

pytestmark = pytest.mark.slow


def test_a_run_stopped_with_ctrl_c_is_stopped_not_dead(tmp_path):
    run, _ = stopped_with_ctrl_c(tmp_path)
    assert {s["state"] for s in run.statuses().records} == {"running"}  # no save on SIGTERM
    code, report, text = diagnose(run)
    assert code == 0, text
    assert not [f["title"] for f in report["findings"] if f["severity"] != "info"], text
    top = report["findings"][0]
    assert "stopped" in top["title"] and "interrupted" in top["title"], (
        top, {r: v.get("process") for r, v in report["evidence"]["ranks"].items()},
        [(e.get("event"), e.get("time"), e.get("pid")) for e in run.events()][-8:])
    assert not [f for f in report["findings"] if f["category"] == "rank_dead"], text
