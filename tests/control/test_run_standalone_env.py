"""`trainwatch run -- torchrun --standalone ...` gets MASTER_ADDR on loopback (issue #34).

torchrun --standalone advertises the hostname, and where it resolves to nothing the
workers hang; the command's environment carries torchrun's PET_LOCAL_ADDR=127.0.0.1
(trainer/rendezvous.py; the rules are tests/trainer/test_trainer_rendezvous.py's).
"""

from __future__ import annotations

from trainwatch.contract.env import TORCHRUN_LOCAL_ADDR_ENV
from trainwatch.control.command import supervised_job
from trainwatch.rundir.run_dir import RunDir


def test_trainwatch_run_hands_a_standalone_command_loopback(tmp_path, monkeypatch):
    monkeypatch.delenv(TORCHRUN_LOCAL_ADDR_ENV, raising=False)
    run = RunDir(tmp_path / "r")
    standalone = supervised_job(run, ["torchrun", "--standalone", "train.py"], "trainwatch run")
    assert standalone.env[TORCHRUN_LOCAL_ADDR_ENV] == "127.0.0.1"
    plain = supervised_job(run, ["torchrun", "--nnodes", "2", "train.py"], "trainwatch run")
    assert TORCHRUN_LOCAL_ADDR_ENV not in plain.env
