"""`trainwatch diagnose` and `trainwatch report` on a run its user stopped (Ctrl-C on
`trainwatch run`) whose job does not save on SIGTERM (telemetry only,
tests/jobs/diagnose_job.py), one real run for both: its ranks die by the signal with
statuses still saying "running". That is the stop the journal records, not two ranks that
died at once: diagnose has no critical finding, exits 0 and names the stop; report's
incident says the supervisor stopped it and that nothing was saved on the stop, not the
bare journal event ("job_stopped with exit code 1"); the closing summary says the same."""

import json
import subprocess
import sys

import pytest

from diagnose_helpers import diagnose, stopped_with_ctrl_c

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """The stopped run and what `trainwatch run` printed."""
    return stopped_with_ctrl_c(tmp_path_factory.mktemp("stopped"))


def test_a_run_stopped_with_ctrl_c_is_stopped_not_dead(stopped):
    run, _ = stopped
    assert {s["state"] for s in run.statuses().records} == {"running"}  # no save on SIGTERM
    code, report, text = diagnose(run)
    assert code == 0, text
    assert not [f["title"] for f in report["findings"] if f["severity"] != "info"], text
    top = report["findings"][0]
    assert "stopped" in top["title"] and "interrupted" in top["title"], (
        top, {r: v.get("process") for r, v in report["evidence"]["ranks"].items()},
        [(e.get("event"), e.get("time"), e.get("pid")) for e in run.events()][-8:])
    assert not [f for f in report["findings"] if f["category"] == "rank_dead"], text


def test_a_run_stopped_with_ctrl_c_says_who_stopped_it(stopped):
    run, out = stopped
    assert "stopped by its supervisor" in out and "job_stopped with" not in out, out
    said = "stopped by its supervisor (interrupted); nothing saved on the stop"
    done = subprocess.run([sys.executable, "-m", "trainwatch", "report", str(run.root),
                           "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    causes = [i["cause"] for i in json.loads(done.stdout)["incidents"]]
    assert causes == [said], causes
