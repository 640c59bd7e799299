"""TRAINWATCH_FAULT: specs are validated; faults fire where, when and how often they say."""

import subprocess
import sys
import time

import pytest

from trainwatch.errors import ConfigError
from trainwatch.trainer.faults import Fault, FaultInjector, parse_faults


def test_fault_specs_parse_and_reject_nonsense():
    faults = parse_faults("exit:rank=1:step=5:code=3, slow:rank=0:factor=1.5,"
                          "hang:step=2:attempt=any")
    assert faults[0] == Fault("exit", rank=1, step=5, attempt=0, code=3)
    assert faults[1] == Fault("slow", rank=0, attempt=None, factor=1.5)
    assert faults[2].rank is None and faults[2].attempt is None
    for bad in ("explode:step=1", "exit:rank=1", "sleep:step=1", "slow:factor=0.5",
                "exit:step=x", "exit:step=1:colour=red"):
        with pytest.raises(ConfigError) as info:
            parse_faults(bad)
        assert info.value.file == "TRAINWATCH_FAULT"


def test_slow_fault_window_ends_at_until():
    fault, = parse_faults("slow:factor=2:step=10:until=60")
    assert fault == Fault("slow", step=10, attempt=None, factor=2.0, until=60)
    assert [s for s in (9, 10, 59, 60) if fault.slows(s)] == [10, 59]
    assert parse_faults("slow:factor=2:until=5")[0].slows(0)
    for bad in ("slow:factor=2:step=10:until=10", "slow:factor=2:until=0",
                "exit:step=1:until=3", "slow:factor=2:until=soon"):
        with pytest.raises(ConfigError) as info:
            parse_faults(bad)
        assert info.value.file == "TRAINWATCH_FAULT" and info.value.key == bad


def test_one_shot_faults_fire_on_first_attempt_only():
    faults = parse_faults("sleep:rank=1:step=2:seconds=0.01")
    fired = []
    first = FaultInjector(faults, rank=1, attempt=0, on_fire=lambda f, s: fired.append(s))
    for step in range(4):
        with first.forward(step):
            pass
    assert fired == [2]
    assert FaultInjector(faults, rank=1, attempt=1).faults == []
    assert FaultInjector(faults, rank=0, attempt=0).faults == []


def test_slow_fault_stretches_the_compute_it_wraps():
    fired = []
    slow = FaultInjector(parse_faults("slow:rank=0:factor=2:step=1"), rank=0, attempt=3,
                         on_fire=lambda f, s: fired.append(s))
    with slow.forward(0):
        pass
    started = time.perf_counter()
    with slow.forward(1):
        time.sleep(0.02)
    # forward 20 ms, then (2 - 1) x 3 x forward more: a step twice as long (sleeps never end early)
    assert time.perf_counter() - started >= 0.02 + 3 * 0.02
    with slow.forward(2):
        pass
    assert fired == [1]  # journaled once, at the first slowed step


def test_kill_and_exit_faults_end_the_process_like_a_crash():
    script = ("from trainwatch.trainer.faults import FaultInjector, parse_faults\n"
              "import sys\n"
              "f = FaultInjector(parse_faults(sys.argv[1]), rank=0, attempt=0)\n"
              "for step in range(5):\n"
              "    with f.forward(step):\n"
              "        pass\n")
    for spec, code in (("kill:step=2", -9), ("exit:step=2:code=7", 7), ("exit:step=9", 0)):
        proc = subprocess.run([sys.executable, "-c", script, spec], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == code, (spec, proc.stderr)


def test_nan_fault_makes_the_loss_non_finite_once_at_its_step():
    import math

    import torch

    (fault,) = parse_faults("nan:rank=1:step=3")
    assert fault == Fault("nan", rank=1, step=3, attempt=0)
    fired = []
    injector = FaultInjector([fault], rank=1, attempt=0, on_fire=lambda f, s: fired.append(s))
    losses = [injector.loss(step, torch.tensor(2.0)).item() for step in (2, 3, 3, 4)]
    assert losses[0] == 2.0 and math.isnan(losses[1]) and losses[2:] == [2.0, 2.0]
    assert fired == [3]
    with injector.forward(3):  # the forward hook leaves nan alone (it acts on the loss)
        pass
    assert fired == [3]
    always = FaultInjector(parse_faults("nan:step=0:attempt=any"), rank=0, attempt=2)
    assert math.isnan(always.loss(0, torch.tensor(1.0)).item())
    assert FaultInjector([fault], rank=1, attempt=1).faults == []
    with pytest.raises(ConfigError):
        parse_faults("nan:rank=0")  # needs step=N


def test_launch_limits_a_fault_to_one_start_of_the_job_by_a_controller():
    (fault,) = parse_faults("hang:rank=1:step=4:launch=1")
    assert fault == Fault("hang", rank=1, step=4, attempt=0, launch=1)
    assert FaultInjector([fault], rank=1, attempt=0, launch=1).faults == [fault]
    assert FaultInjector([fault], rank=1, attempt=0, launch=2).faults == []  # restarted: clean
    (anytime,) = parse_faults("nan:step=4")  # no launch: every start (a corrupt batch)
    assert FaultInjector([anytime], rank=0, attempt=0, launch=3).faults == [anytime]
    for bad in ("hang:step=4:launch=0", "hang:step=4:launch=first"):
        with pytest.raises(ConfigError):
            parse_faults(bad)


def test_the_job_controller_numbers_its_starts_for_the_faults(tmp_path):
    from trainwatch.control.controller import LAUNCH_ENV as SET
    from trainwatch.control.controller import JobController
    from trainwatch.trainer.faults import LAUNCH_ENV as READ

    assert SET == READ
    out = tmp_path / "launches.txt"
    controller = JobController(tmp_path / "run", [
        sys.executable, "-c",
        f"import os; open({str(out)!r}, 'a').write(os.environ[{READ!r}] + '\\n')"])
    for _ in range(2):
        controller.start()
        assert controller.proc.wait(timeout=60) == 0
    assert out.read_text().split() == ["1", "2"]


@pytest.mark.parametrize("dtype,bit", [("float32", 20), ("bfloat16", 20), ("float32", 31)])
def test_sdc_flips_one_bit_of_one_weight_once_after_its_step(dtype, bit):
    import torch

    (fault,) = parse_faults(f"sdc:rank=1:step=3:bit={bit}")
    assert fault == Fault("sdc", rank=1, step=3, attempt=0, bit=bit)
    model = torch.nn.Linear(4, 2).to(getattr(torch, dtype))
    before = [p.detach().clone() for p in model.parameters()]
    injector = FaultInjector([fault], rank=1, attempt=0)
    with injector.forward(3):  # the forward leaves it alone: it acts after the update
        pass
    injector.corrupt(2, model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    injector.corrupt(3, model)
    injector.corrupt(3, model)  # once per process
    weight = next(model.parameters())
    width = 8 * weight.element_size()
    ints = {16: torch.int16, 32: torch.int32}[width]
    changed = (before[0].view(ints) ^ weight.detach().view(ints)).view(-1)
    flipped = 1 << min(bit, width - 1)
    assert int(changed[0]) & ((1 << width) - 1) == flipped and not changed[1:].any()
    for bad in ("sdc:rank=1", "sdc:step=3:bit=32", "sdc:step=3:bit=-1"):
        with pytest.raises(ConfigError):
            parse_faults(bad)


@pytest.mark.parametrize("dtype,bit,flipped", [("float32", None, 27), ("bfloat16", None, 11),
                                               ("float32", 30, 30)])
def test_reduce_flips_an_exponent_bit_of_the_largest_element_of_a_bucket_once(
        dtype, bit, flipped):
    import torch

    spec = "reduce:rank=1:step=3" + ("" if bit is None else f":bit={bit}")
    (fault,) = parse_faults(spec)
    assert fault == Fault("reduce", rank=1, step=3, attempt=0, bit=bit)
    bucket = torch.tensor([0.5, -3.0, 2.0]).to(getattr(torch, dtype))
    before = bucket.clone()
    injector = FaultInjector([fault], rank=1, attempt=0)
    with injector.forward(3):  # the forward leaves it alone: the reduction check calls it
        pass
    injector.reduce(2, 0, bucket)
    assert torch.equal(bucket, before)
    injector.reduce(3, 0, bucket)
    injector.reduce(3, 1, bucket)  # once per process: the first bucket of the step
    ints = {2: torch.int16, 4: torch.int32}[bucket.element_size()]
    changed = before.view(ints) ^ bucket.view(ints)
    assert int(changed[1]) == 1 << flipped and not changed[0] and not changed[2]
    for bad in ("reduce:rank=1", "reduce:step=3:bit=32"):
        with pytest.raises(ConfigError):
            parse_faults(bad)
