"""``tel.watch(model, optimizer)``: steps and phases found by hooks, no with-blocks."""

import torch

from trainwatch import Checkpoints, Telemetry
from trainwatch.rundir.run_dir import RunDir


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _steps(run_dir):
    return [r for r in RunDir(run_dir).metrics(0).records if r.get("kind") == "step"]


def test_watched_loop_records_steps_phases_and_values(tmp_path):
    model, opt = _setup()
    tel = Telemetry(tmp_path, heartbeat_interval=60).start()
    handle = tel.watch(model, opt)
    for _ in range(5):
        with tel.phase("data"):
            x = torch.randn(4, 8)
        for _ in range(2):  # gradient accumulation: two forwards, one step
            loss = model(x).pow(2).mean()
            loss.backward()
        opt.step()
        opt.zero_grad()
        tel.record(loss=loss, samples=8)
        with torch.no_grad():
            model(x)  # evaluation: not a training step
    handle.remove()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()  # no longer watched
    tel.close()
    records = _steps(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    for r in records:
        assert set(r["phase_seconds"]) >= {"data", "forward", "backward", "optimizer"}
        assert r["step_time_seconds"] >= sum(r["phase_seconds"].values()) * 0.999
        assert isinstance(r["loss"], float) and r["samples"] == 8
    assert RunDir(tmp_path).events("finished")


def test_watched_steps_carry_the_loops_numbers_after_a_resume_and_a_skip(tmp_path):
    model, opt = _setup()
    ckpt = Checkpoints.from_env(tmp_path, every_steps=0, fsync=False)
    ckpt.maybe_save(7, model=model, optimizer=opt)
    ckpt.close()
    (RunDir(tmp_path).control_dir / "skip-steps.json").write_text(
        '{"from_step": 8, "to_step": 8}')

    tel = Telemetry(tmp_path, heartbeat_interval=60).start()
    tel.watch(model, opt)
    ckpt = Checkpoints.from_env(every_steps=0, fsync=False)
    start = ckpt.resume(model=model, optimizer=opt)
    assert start == 7
    for step in range(start, 10):
        if ckpt.should_skip(step):
            continue
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        ckpt.maybe_save(step + 1, model=model, optimizer=opt)
    ckpt.close()
    tel.close()
    assert [r["step"] for r in _steps(tmp_path)] == [7, 9]


def test_disabled_telemetry_adds_no_hooks(tmp_path):
    model, opt = _setup()
    tel = Telemetry(tmp_path, enabled=False)
    tel.watch(model, opt).remove()
    assert not model._forward_pre_hooks and not model._forward_hooks
