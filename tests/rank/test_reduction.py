"""The gradient checksum carried through DDP's all-reduce (trainer/reduction.py,
``Telemetry.check_reduction``): its math, its refusals, and real gloo jobs of a plain DDP
loop (tests/jobs/reduction_job.py) with and without a bucket corrupted in transit."""

import json
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import REPO, torchrun_env
from trainwatch.errors import ConfigError
from trainwatch.rank import reduction
from trainwatch.trainer.faults import FaultInjector, parse_faults
from trainwatch.rank.reduction import ReductionCheck, verdict
from trainwatch.rank.telemetry import Telemetry

EPS32 = torch.finfo(torch.float32).eps


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _train(ddp, steps, tel=None):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(steps):
        with tel.step(step) if tel is not None else _Step():
            ddp(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()


class _Step:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_verdict_tolerance_is_eps_times_the_abs_sums_and_nan_is_outside():
    v = verdict(7, 1, [10.0, 30.0, 300.0], elements=100, eps=EPS32, world=3)
    assert v.expected == 10.0 and v.tolerance == pytest.approx(300 * EPS32, rel=1e-6)
    assert not v.mismatch
    assert not verdict(7, 1, [10.0 + 200 * EPS32, 30.0, 300.0], elements=100, eps=EPS32,
                       world=3).mismatch
    assert verdict(7, 1, [10.0 + 400 * EPS32, 30.0, 300.0], elements=100, eps=EPS32,
                   world=3).mismatch
    assert verdict(7, 1, [float("nan"), 30.0, 300.0], elements=100, eps=EPS32, world=3).mismatch
    # A NaN gradient sent by a rank is the non-finite guard's, not a wrong reduction.
    assert not verdict(7, 1, [float("nan"), float("nan"), float("nan")], elements=100,
                       eps=EPS32, world=3).mismatch
    assert v.record() == {"step": 7, "bucket": 1, "reduced_sum": 10.0, "expected_sum": 10.0,
                          "tolerance": v.tolerance}


def test_not_ddp_or_a_model_with_a_hook_is_refused_saying_so(group):
    with pytest.raises(ConfigError, match="needs the DistributedDataParallel model"):
        ReductionCheck(_model(), 5, lambda: 0)
    ddp = DDP(_model())
    ddp.register_comm_hook(None, allreduce_hook)
    with pytest.raises(ConfigError, match=r"already has a DDP communication hook \(allreduce_hook"):
        ReductionCheck(ddp, 5, lambda: 0)
    builtin = DDP(_model())
    builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    with pytest.raises(ConfigError, match="already has a DDP communication hook"):
        ReductionCheck(builtin, 5, lambda: 0)
    with pytest.raises(ValueError, match="every must be a positive"):
        ReductionCheck(DDP(_model()), 0, lambda: 0)


def test_unchecked_steps_are_ddp_s_own_reduction(group, monkeypatch):
    plain, hooked = DDP(_model()), DDP(_model())
    check = ReductionCheck(hooked, 10, lambda: step)
    calls = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: calls.append(a[0].numel()) or
                        real(*a, **k))
    for step in range(9):  # steps 0-8: none is due at every=10
        torch.manual_seed(step)
        _train(plain, 1)
        torch.manual_seed(step)
        _train(hooked, 1)
    assert not check.taken
    assert calls == []  # the process group's own all-reduce, not torch's Python wrapper
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), hooked.parameters()))
    step = 9
    _train(hooked, 1)
    assert len(calls) == 2 and calls[0] == 2  # the checked step: the two scalars, the bucket
    assert [v.mismatch for v in check.resolve()] == [False]


def test_an_unchecked_step_does_no_more_work_than_ddp_s_own_path(group):
    """The hook runs on every step and checks one in 50 (issue #38's per-step cost): the
    other steps' backward runs no more tensor operations than DDP without a hook (torch's
    ``allreduce_hook`` adds a division pass) and three Python calls a bucket: the hook,
    the step's lookup (this test's lambda; ``Telemetry`` passes a C one) and ``_first``."""
    plain, hooked = DDP(_model()), DDP(_model())
    ReductionCheck(hooked, 10, lambda: 0)
    ops = {}
    for name, ddp in (("plain", plain), ("hooked", hooked)):
        _train(ddp, 1)  # DDP's first backward builds its buckets
        loss = ddp(torch.randn(8, 16)).sum()
        with _Ops() as ops[name]:
            loss.backward()
    assert "aten.div_.Tensor" not in ops["hooked"].ops
    assert len(ops["hooked"].ops) <= len(ops["plain"].ops), (ops["hooked"].ops, ops["plain"].ops)
    calls = []
    loss = hooked(torch.randn(8, 16)).sum()
    sys.setprofile(lambda frame, event, _: calls.append(frame.f_code.co_name)
                   if event == "call" else None)
    try:
        loss.backward()
    finally:
        sys.setprofile(None)
    # ``_first`` runs here only if the all-reduce is done by then (else on gloo's thread)
    assert calls[calls.index("hook"):] in (["hook", "<lambda>"],
                                           ["hook", "<lambda>", "_first"]), calls


class _Ops(TorchDispatchMode):
    """The tensor operations run while it is on (the DDP reducer's in C++ included)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bit,caught", [(27, True), (30, True), (22, True), (3, False)])
def test_a_bucket_changed_after_its_checksum_is_caught_unless_under_the_rounding(
        group, bit, caught):
    ddp = DDP(_model())
    current = [0]
    check = ReductionCheck(ddp, 1, lambda: current[0])
    _train(ddp, 3)  # clean steps: no mismatch
    assert not any(v.mismatch for v in check.resolve())
    check.tamper = FaultInjector(parse_faults(f"reduce:step=3:bit={bit}"), rank=0,
                                 attempt=0).reduce
    for current[0] in range(3, 6):
        _train(ddp, 1)
    verdicts = check.resolve()
    assert [v.step for v in verdicts if v.mismatch] == ([3] if caught else [])


def test_telemetry_counts_records_and_logs_a_mismatch(group, tmp_path):
    ddp = DDP(_model())
    tel = Telemetry(tmp_path / "run", heartbeat_interval=3600, exchange_every=0).start()
    check = tel.check_reduction(ddp, every=5)
    check.tamper = FaultInjector(parse_faults("reduce:step=9"), rank=0, attempt=0).reduce
    _train(ddp, 12, tel)
    tel.close()
    status = json.loads((tmp_path / "run" / "status" / "rank-00000.json").read_text())
    assert status["counters"]["reduction_mismatches_total"] == 1
    assert status["reduction"]["every"] == 5 and status["reduction"]["step"] == 9
    [mismatch] = status["reduction"]["mismatches"]
    assert mismatch["step"] == 9 and mismatch["bucket"] == 0
    assert abs(mismatch["reduced_sum"] - mismatch["expected_sum"]) > mismatch["tolerance"]
    assert status["last_reduction_mismatch_at"] > status["started_at"]
    logged = [json.loads(line) for line in
              (tmp_path / "run" / "metrics" / "rank-00000.jsonl").read_text().splitlines()]
    assert [{k: r[k] for k in mismatch} for r in logged if r["kind"] == "reduction"] == [
        mismatch]


def test_checks_the_reader_fell_behind_on_are_bounded_and_counted(group, tmp_path, monkeypatch):
    monkeypatch.setattr(reduction, "PENDING", 2)
    ddp = DDP(_model())
    tel = Telemetry(tmp_path / "run", heartbeat_interval=3600, exchange_every=0).start()
    tel.check_reduction(ddp, every=1)
    _train(ddp, 5, tel)  # one bucket a step, no flush until close
    tel.close()
    status = json.loads((tmp_path / "run" / "status" / "rank-00000.json").read_text())
    assert status["reduction"]["step"] == 4 and status["counters"]["telemetry_errors_total"] == 1


def test_a_disabled_telemetry_takes_no_hook(group, tmp_path):
    ddp = DDP(_model())
    assert Telemetry(tmp_path / "run", enabled=False).check_reduction(ddp) is None
    assert not ddp._comm_hooks


def _job(tmp_path, nproc, steps, every, dtype, fault=None, twin=False):
    run_dir = tmp_path / "run"
    extra = {"TRAINWATCH_FAULT": fault} if fault else {}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={nproc}", str(REPO / "tests/jobs/reduction_job.py"), str(run_dir),
         str(steps), str(every), dtype] + (["twin"] if twin else []),
        env=torchrun_env(tmp_path, **extra), capture_output=True, text=True, timeout=300,
        cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    statuses = [json.loads((run_dir / "status" / f"rank-{r:05d}.json").read_text())
                for r in range(nproc)]
    return statuses, done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_no_false_mismatch_over_many_steps_of_real_training(tmp_path, dtype):
    """3 gloo ranks (so the division by the world size rounds), every other step checked;
    the steps between are DDP's mean to the rounding (``ReduceOp.AVG``: sum, then divide),
    checked against a copy of the model trained without the hook."""
    statuses, stderr = _job(tmp_path, 3, 300, 2, dtype, twin=True)
    # Found anywhere in a line: three ranks and torchrun share the stderr pipe, and another
    # process's C++ warning written in pieces can land before a rank's line (once in CI).
    differences = [float(m) for m in re.findall(
        r"twin gradient difference ([0-9.e+-]+|nan|inf)", stderr)]
    assert len(differences) == 3 and max(differences) <= 16 * torch.finfo(
        getattr(torch, dtype)).eps, differences
    for s in statuses:
        assert s["reduction"] == {"every": 2, "step": 299, "mismatches": []}, s["reduction"]
        assert s["counters"]["reduction_mismatches_total"] == 0
        assert s["last_reduction_mismatch_at"] is None


@pytest.mark.slow
def test_own_loop_a_corrupted_reduction_is_caught_while_the_replicas_agree(tmp_path):
    """Rank 1's bucket is corrupted in step 29's all-reduce: every rank receives the same
    wrong gradient, so their parameter digests agree, and every rank's checksum says so."""
    statuses, stderr = _job(tmp_path, 2, 40, 5, "float32", fault="reduce:rank=1:step=29")
    assert "injecting fault reduce" in stderr
    for s in statuses:
        assert s["counters"]["reduction_mismatches_total"] == 1, s["reduction"]
        assert [(m["step"], m["bucket"]) for m in s["reduction"]["mismatches"]] == [(29, 0)]
    assert statuses[0]["reduction"]["mismatches"] == statuses[1]["reduction"]["mismatches"]
    digests = [[(d["step"], d["bits"]) for d in s["replicas"]] for s in statuses]
    assert digests[0] == digests[1] and [d[0] for d in digests[0]] == list(range(4, 40, 5))
    for rank in range(2):
        logged = [json.loads(line) for line in (tmp_path / "run" / "metrics" /
                                                f"rank-{rank:05d}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in logged if r["kind"] == "reduction"] == [29]

