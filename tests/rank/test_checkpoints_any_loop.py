"""``Checkpoints`` (the checkpoint library for any loop) and what Telemetry learns from a job:
resume into model/optimizer/extras, schedule, final save, rollback skips, SIGTERM,
declared saves, ``finished`` and run.json; ``import trainwatch`` stays torch-free."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from trainwatch import Checkpoints, Telemetry
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rank.checkpoint import EXIT_STOPPED
from trainwatch.checkpoint_format.catalog import complete


class Cursor:
    """Picklable state without state_dict (a user's own object)."""

    def __init__(self, position):
        self.position = position


def _model():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    return model, opt, sched


def _train(model, opt, sched, steps, ckpt, start=0, **extra):
    for step in range(start, steps):
        if ckpt.should_skip(step):
            continue
        loss = model(torch.randn(8, 4)).pow(2).mean()  # global RNG: restored on resume
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        ckpt.maybe_save(step + 1, model=model, optimizer=opt, scheduler=sched, **extra)


def test_resume_continues_exactly_and_restores_every_kind_of_state(tmp_path):
    run = tmp_path / "run"
    model, opt, sched = _model()
    ckpt = Checkpoints.from_env(run, every_steps=4, fsync=False)
    assert ckpt.resume(model=model, optimizer=opt) == 0
    _train(model, opt, sched, 10, ckpt, extra={"epoch": 1}, cursor=Cursor(7))
    ckpt.close()
    steps = [e.step for e in complete(RunDir(run).checkpoint_dir)]
    assert steps[:2] == [10, 8]  # the final step saved by close(), and the schedule's

    # The uninterrupted reference: the same first 10 steps (same seed), then 5 more.
    ref_model, ref_opt, ref_sched = _model()
    ckpt_ref = Checkpoints.from_env(tmp_path / "ref", every_steps=0, fsync=False)
    _train(ref_model, ref_opt, ref_sched, 15, ckpt_ref)
    ckpt_ref.close()

    model2, opt2, sched2 = _model()
    extra, cursor = {}, Cursor(0)
    ckpt2 = Checkpoints.from_env(run, every_steps=4, fsync=False)
    start = ckpt2.resume(model=model2, optimizer=opt2, scheduler=sched2, extra=extra,
                         cursor=cursor)
    assert start == 10
    assert extra == {"epoch": 1}                      # a dict: updated in place
    assert ckpt2.loaded["cursor"].position == 7       # any picklable object
    assert sched2.last_epoch == sched.last_epoch
    _train(model2, opt2, sched2, 15, ckpt2, start=10)
    ckpt2.close()
    for resumed_p, ref_p in zip(model2.parameters(), ref_model.parameters()):
        assert torch.equal(resumed_p, ref_p)  # bit for bit: weights, Adam state, RNG, LR
    resumed = RunDir(run).events("checkpoint_resumed")
    assert resumed and resumed[-1]["step"] == 10


def test_resume_restores_the_random_streams(tmp_path):
    model, opt, _ = _model()
    ckpt = Checkpoints.from_env(tmp_path, every_steps=1, fsync=False)
    ckpt.resume(model=model)
    torch.manual_seed(123)
    ckpt.maybe_save(1, model=model)
    ckpt.close()
    expected = torch.rand(3)
    torch.manual_seed(999)
    ckpt2 = Checkpoints.from_env(tmp_path, every_steps=1, fsync=False)
    assert ckpt2.resume(model=model) == 1
    assert torch.equal(torch.rand(3), expected)
    ckpt2.close(final=False)


def test_should_skip_follows_the_rollback_request_and_journals_it(tmp_path):
    run = RunDir(tmp_path).create()
    (run.control_dir / "skip-steps.json").write_text(
        json.dumps({"from_step": 3, "to_step": 5, "reason": "NaN at step 5"}))
    ckpt = Checkpoints.from_env(tmp_path, every_steps=0, fsync=False)
    ckpt.resume()
    assert [s for s in range(8) if ckpt.should_skip(s)] == [3, 4, 5]
    ckpt.close(final=False)
    skipped = run.events("data_skipped")
    assert skipped[-1]["steps"] == [3, 4, 5] and skipped[-1]["reason"] == "NaN at step 5"


def test_bad_setting_names_the_key(tmp_path):
    from trainwatch.errors import ConfigError
    with pytest.raises(ConfigError, match="every_step"):
        Checkpoints.from_env(tmp_path, every_step=5)


def test_sigterm_saves_then_exits_with_stopped(tmp_path):
    model, _, _ = _model()
    previous = signal.getsignal(signal.SIGTERM)
    ckpt = Checkpoints.from_env(tmp_path, every_steps=0, fsync=False)
    os.kill(os.getpid(), signal.SIGTERM)  # handled: only a flag until the next boundary
    with pytest.raises(SystemExit) as stopped:
        ckpt.maybe_save(3, model=model)
    assert stopped.value.code == EXIT_STOPPED
    newest = complete(RunDir(tmp_path).checkpoint_dir)[0]
    assert newest.step == 3 and newest.manifest["reason"] == "stop"
    assert signal.getsignal(signal.SIGTERM) == previous  # handlers given back


def test_a_sigterm_repeated_at_once_still_saves_one_later_kills(tmp_path):
    """A killed `trainwatch run` delivers SIGTERM to torchrun once per thread it had
    (PR_SET_PDEATHSIG), and torchrun passes each on to the ranks within milliseconds: the
    repeat is the same stop, and the rank still saves (it died unsaved, steps lost). A
    second SIGTERM that comes later, the loop having had time to reach a boundary, still
    kills at once."""
    job = (
        "import os, signal, sys, time, torch\n"
        "from trainwatch import Checkpoints\n"
        "model = torch.nn.Linear(4, 2)\n"
        "ckpt = Checkpoints.from_env(sys.argv[1], every_steps=0, fsync=False)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "os.kill(os.getpid(), signal.SIGTERM)  # the repeat, at once\n"
        "if sys.argv[2] == 'later':\n"
        "    time.sleep(3)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(5)\n"
        "ckpt.maybe_save(3, model=model)\n")
    now = subprocess.run([sys.executable, "-c", job, str(tmp_path / "now"), "now"],
                         capture_output=True, text=True, timeout=120)
    assert now.returncode == EXIT_STOPPED, now.stderr[-2000:]
    assert complete(RunDir(tmp_path / "now").checkpoint_dir)[0].step == 3
    later = subprocess.run([sys.executable, "-c", job, str(tmp_path / "later"), "later"],
                           capture_output=True, text=True, timeout=120)
    assert later.returncode == -signal.SIGTERM, later.stderr[-2000:]


def test_telemetry_reports_saves_it_finds_and_saves_the_job_declares(tmp_path):
    tel = Telemetry.from_env(tmp_path, heartbeat_interval=0.1).start()
    ckpt = Checkpoints.from_env(every_steps=1, fsync=False)  # run dir and telemetry found
    assert ckpt.telemetry is tel and ckpt.run.root == tmp_path
    model, _, _ = _model()
    with tel.step(0) as s:
        s.record(loss=1.0)
    ckpt.maybe_save(1, model=model)
    ckpt.close(final=False)
    assert tel.snapshot()["checkpoint"]["step"] == 1
    own = tmp_path / "own.pt"
    own.write_bytes(b"x")
    tel.checkpoint_saved(own, 7)
    facts = tel.snapshot()["checkpoint"]
    assert facts["step"] == 7 and facts["declared"] and facts["ok"] and facts["time"]
    tel.close()
    run = RunDir(tmp_path)
    declared = [e for e in run.events("checkpoint_saved") if e.get("declared")]
    assert declared[-1]["step"] == 7 and declared[-1]["path"] == str(own.resolve())
    assert len(run.events("finished")) == 1
    info = run.run_info()
    assert info["world_size"] == 1 and info["started_at"] and info["command"]
    status = json.loads(run.status_file(0).read_text())
    assert status["state"] == "finished" and status["checkpoint"]["step"] == 7


def test_a_loop_that_journals_finished_itself_gets_it_once(tmp_path):
    tel = Telemetry.from_env(tmp_path).start()
    tel.event("finished", step=3)
    tel.close()
    assert len(RunDir(tmp_path).events("finished")) == 1


def test_import_trainwatch_does_not_import_torch():
    code = ("import sys, trainwatch, trainwatch.cli; assert 'torch' not in sys.modules; "
            "print(trainwatch.__version__)")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_state_with_nan_is_not_saved_so_the_good_checkpoints_stay(tmp_path):
    model, _, _ = _model()
    ckpt = Checkpoints.from_env(tmp_path, every_steps=1, keep_last=1, fsync=False)
    ckpt.maybe_save(1, model=model)
    ckpt.wait()
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    ckpt.maybe_save(2, model=model)
    ckpt.close(final=False)
    assert [e.step for e in complete(RunDir(tmp_path).checkpoint_dir)] == [1]
    skipped = RunDir(tmp_path).events("checkpoint_skipped")
    assert skipped[-1]["policy"] == "nonfinite" and "model.weight" in skipped[-1]["reason"]
