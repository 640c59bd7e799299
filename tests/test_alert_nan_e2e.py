"""NaN at a known batch -> TrainingLossNonFinite -> roll back and skip -> finite finish.

Real pieces: torchrun with two gloo ranks (tests/alert_nan_job.py), the checkpoint
library, the agent exporting the ranks' counters, the embedded engine scraping it, the
controller and the supervisor.  Batch 23 is corrupt on every attempt, so only skipping
its data lets the run finish.
"""

import importlib.util
import math
import subprocess
import sys

import pytest

from conftest import REPO, torchrun_env
from trainwatch.alerts.actions import ActionRunner, Policy
from trainwatch.alerts.controller import JobController
from trainwatch.alerts.engine import Engine
from trainwatch.alerts.evaluate import History
from trainwatch.alerts.loop import EngineLoop, connect_actions
from trainwatch.alerts.notify import JournalNotifier
from trainwatch.alerts.rules import load_rules
from trainwatch.alerts.scrape import Scraper
from trainwatch.alerts.supervise import Supervisor
from trainwatch.rundir import RunDir

from test_alert_prometheus_e2e import _free_port

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("trainwatch.agent.daemon") is None
    or importlib.util.find_spec("trainwatch.trainer.checkpoint") is None,
    reason="needs the agent and the checkpoint library")]


def test_nan_batch_is_rolled_back_skipped_and_the_run_finishes(tmp_path):
    run = RunDir(tmp_path / "exp1").create()
    (tmp_path / "agent.yaml").write_text("collectors:\n  ranks: {interval: 0.5}\n")
    (tmp_path / "t.yaml").write_text("evaluation_interval: 1s\n")
    port = _free_port()
    agent = subprocess.Popen([sys.executable, "-m", "trainwatch", "agent", "--run-dir",
                              str(run.root), "--listen", f"127.0.0.1:{port}", "--config",
                              str(tmp_path / "agent.yaml")],
                             stdout=open(tmp_path / "agent.log", "wb"), stderr=subprocess.STDOUT)
    ruleset = load_rules(thresholds_file=tmp_path / "t.yaml")
    history = History()
    engine = Engine(ruleset, history, notifiers=[JournalNotifier(str(run.root))])
    loop = EngineLoop(engine, Scraper(history, [f"127.0.0.1:{port}"]), 1.0)
    controller = JobController(
        run.root, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node=2", str(REPO / "tests" / "alert_nan_job.py"),
                   str(run.root), "60"], env=torchrun_env(tmp_path), stop_grace_seconds=5)
    runner = ActionRunner(run.root, controller, Policy(min_interval_seconds=60,
                                                       guard_max_restarts=2))
    connect_actions(engine, runner, loop)
    supervisor = Supervisor(controller, runner)
    try:
        controller.start()
        loop.start()
        supervisor.start()
        assert supervisor.finished.wait(300), "the run did not end"
    finally:
        supervisor.stop()
        loop.stop()
        if controller.alive():
            controller.stop("test teardown")
        agent.terminate()
        agent.wait(timeout=30)
    assert supervisor.exit_code == 0
    firing = run.events("alert_firing")
    assert firing[0]["alert"] == "TrainingLossNonFinite"
    taken = run.events("action_taken")
    assert len(taken) == 1 and taken[0]["action"] == "rollback_skip", taken
    assert taken[0]["bad_step"] == 23 and taken[0]["resume_step"] == 20
    assert taken[0]["skip"]["from_step"] == 21 and taken[0]["skip"]["to_step"] == 23
    assert {q["step"] for q in taken[0]["quarantined"]} >= {25}
    skipped = run.events("data_skipped")
    assert skipped and skipped[-1]["steps"] == [21, 22, 23]
    resumed = run.events("checkpoint_resumed")
    assert resumed and resumed[-1]["step"] == 20
    finished = run.events("finished")  # only the rolled-back attempt got to the end
    assert len(finished) == 1 and finished[0]["step"] == 59
    assert math.isfinite(finished[0]["loss"])
    names = [e["event"] for e in run.events()]
    firsts = [names.index(n) for n in ("nonfinite_detected", "alert_firing", "action_taken",
                                       "checkpoint_resumed", "data_skipped", "finished")]
    assert firsts == sorted(firsts)
