"""`trainwatch report` on a run its user stopped (Ctrl-C on `trainwatch run`) whose job
does not save on SIGTERM (telemetry only, tests/jobs/diagnose_job.py): the incident says
the supervisor stopped it and that nothing was saved on the stop, not the bare journal
event ("job_stopped with exit code 1"); the closing summary says the same."""

import json
import subprocess
import sys

import pytest

from diagnose_helpers import stopped_with_ctrl_c

pytestmark = pytest.mark.slow


def test_a_run_stopped_with_ctrl_c_says_who_stopped_it(tmp_path):
    run, out = stopped_with_ctrl_c(tmp_path)
    assert "stopped by its supervisor" in out and "job_stopped with" not in out, out
    said = "stopped by its supervisor (interrupted); nothing saved on the stop"
    done = subprocess.run([sys.executable, "-m", "trainwatch", "report", str(run.root),
                           "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    causes = [i["cause"] for i in json.loads(done.stdout)["incidents"]]
    assert causes == [said], causes
