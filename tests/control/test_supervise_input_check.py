"""The supervisor's look for a rank that died on bad input while the job runs reads every
status of the run: in a shared run directory of thousands of ranks it must stay a small
share of the supervisor's time, not a full read every poll."""

import sys
import time

from trainwatch.control.actions import ActionRunner, Policy
from trainwatch.control.controller import JobController
from trainwatch.control.supervise import INPUT_CHECK_SHARE, Supervisor


def test_reading_thousands_of_statuses_for_bad_input_takes_a_bounded_share(tmp_path):
    controller = JobController(tmp_path / "run", [sys.executable, "-c",
                                                  "import time; time.sleep(120)"],
                               stop_grace_seconds=3)
    for rank in range(2000):
        controller.run.write_status(rank, {"rank": rank, "pid": 1, "state": "running",
                                           "started_at": time.time(), "step": 5})
    spent: list[float] = []
    read = controller.rejected_input

    def timed() -> str | None:
        began = time.monotonic()
        try:
            return read()
        finally:
            spent.append(time.monotonic() - began)

    controller.rejected_input = timed  # type: ignore[method-assign]
    sup = Supervisor(controller, ActionRunner(controller.run.root, controller, Policy()),
                     poll_seconds=0.05)
    controller.start()
    try:
        began = time.monotonic()
        while time.monotonic() - began < 3.0:
            sup.check()
            time.sleep(0.05)
        elapsed = time.monotonic() - began
    finally:
        controller.stop("test teardown")
    assert spent, "the running job was never looked at"
    # the first look is free to take its time; the share holds after it
    assert sum(spent[1:]) <= 2 * INPUT_CHECK_SHARE * elapsed, (len(spent), sum(spent))
    assert not sup.finished.is_set()
