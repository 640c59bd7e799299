"""An own loop's evaluation between steps (`with tel.phase("eval")`, longer than the stall
budget) is booked by `trainwatch report` as evaluation, not as a stall: the telemetry
writes an `eval` record after the step, as the reference trainer's evaluations have. One
before the first step (the loop evaluates first) is evaluation too, not start-up: its
record carries the step the loop runs next and how long it took."""

import json
import subprocess
import sys

import pytest

from trainwatch.contract.stall import STALL_DEFAULTS

pytestmark = pytest.mark.slow
EVAL_SECONDS = STALL_DEFAULTS["floor_seconds"] + 1.5   # past any ordinary budget here
FIRST_EVAL_SECONDS = 1.0

LOOP = """
import sys, time
from trainwatch import Telemetry
tel = Telemetry(sys.argv[1], heartbeat_interval=0.2).start()
with tel.phase("eval"):
    time.sleep(float(sys.argv[3]))
for step in range(6):
    with tel.step(step) as s:
        time.sleep(0.05)
        s.record(loss=1.0)
    if step == 2:
        with tel.phase("eval"):
            time.sleep(float(sys.argv[2]))
tel.close()
"""


def test_an_eval_phase_between_steps_is_evaluation_not_a_stall(tmp_path):
    run_dir = tmp_path / "run"
    subprocess.run([sys.executable, "-c", LOOP, str(run_dir), str(EVAL_SECONDS),
                    str(FIRST_EVAL_SECONDS)], check=True, timeout=120)
    done = subprocess.run([sys.executable, "-m", "trainwatch", "report", str(run_dir), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["categories"]["stalled"] == 0, data["categories"]
    assert data["categories"]["evaluation"] == pytest.approx(
        EVAL_SECONDS + FIRST_EVAL_SECONDS, abs=0.5)
    assert not data["skipped"]["metrics_lines"]
    records = [json.loads(line) for line in
               (run_dir / "metrics" / "rank-00000.jsonl").read_text().splitlines()]
    first = next(r for r in records if r["kind"] == "eval")
    assert first["step"] == 0 and first["before_step"] is True
    assert first["seconds"] == pytest.approx(FIRST_EVAL_SECONDS, abs=0.2)
