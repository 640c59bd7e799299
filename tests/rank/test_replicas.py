"""Replica digests (trainer/replicas.py) and the agent's vote on them (agent/replicas.py)."""

import json
import struct

import pytest
import torch

from trainwatch.agent.replicas import ReplicaJudge
from trainwatch.contract.replicas import digests, suspects_label, vote
from trainwatch.rank.replicas import ReplicaCheck, bits_hex, digest, tensors_of
from trainwatch.rank.telemetry import Telemetry


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4)).to(dtype)


def _hex(model, optimizer=None):
    return bits_hex(digest(tensors_of(model, optimizer))[0].item())


def _flip(t, index, bit):
    """Flip one bit of one element, in place, through an integer view."""
    ints = t.data.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    flat = ints.view(-1)
    flat[index] ^= torch.tensor(1 << bit if bit < 8 * t.element_size() - 1
                                else -(1 << bit), dtype=ints.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_every_single_bit_flip_changes_the_digest(dtype):
    model = _model(dtype=dtype)
    clean = _hex(model)
    assert clean == _hex(_model(dtype=dtype))  # replicas: bitwise equal, same digest
    width = 8 * next(model.parameters()).element_size()
    for p_index, p in enumerate(model.parameters()):
        for element in (0, p.numel() - 1):
            for bit in range(width):
                _flip(p, element, bit)
                assert _hex(model) != clean, (dtype, p_index, element, bit)
                _flip(p, element, bit)
    assert _hex(model) == clean


def test_the_same_change_in_another_tensor_is_another_digest():
    a, b = _model(), _model()
    first, last = list(a.parameters())[0], list(b.parameters())[-1]
    _flip(first, 0, 3)
    _flip(last, 0, 3)
    assert _hex(a) != _hex(b)


def test_optimizer_state_is_covered():
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 16)).sum().backward()
    opt.step()
    with_state = _hex(model, opt)
    assert with_state != _hex(model)
    _flip(opt.state[next(model.parameters())]["exp_avg"], 5, 1)
    assert _hex(model, opt) != with_state


def test_norm_for_the_tolerance_mode():
    model = _model()
    _, norm = digest(tensors_of(model), with_norm=True)
    expected = sum(float(p.detach().double().pow(2).sum()) for p in model.parameters()) ** 0.5
    assert norm is not None and norm.dtype == torch.float64
    assert abs(norm.item() - expected) < 1e-9 * expected


def test_check_validates_its_arguments():
    for bad in ({"every": 0}, {"tolerance": -1.0}, {"group": True}, {"group": 1.5}):
        with pytest.raises(ValueError):
            ReplicaCheck(_model(), **bad)


def test_telemetry_publishes_digests_in_status_and_beat(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = Telemetry(tmp_path / "run", heartbeat_interval=3600, exchange_every=0)
    tel.start()
    tel.check_replicas(model, every=5, replica_group="tp0")
    after = {}
    for step in range(12):
        with tel.step(step):
            model(torch.ones(2, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
        if step in (4, 9):
            after[step] = _hex(model)
    tel.close()
    status = json.loads((tmp_path / "run" / "status" / "rank-00000.json").read_text())
    assert [d["step"] for d in status["replicas"]] == [4, 9]
    assert status["replicas"][0] == {"step": 4, "group": "tp0", "bits": after[4],
                                     "norm": None, "tolerance": None}
    assert status["replicas"][1]["bits"] == after[9]
    beat = (tmp_path / "run" / "status" / "rank-00000.beat").read_text()
    assert '"replica_step":9' in beat
    logged = [json.loads(line) for line in
              (tmp_path / "run" / "metrics" / "rank-00000.jsonl").read_text().splitlines()]
    assert [(r["step"], r["bits"]) for r in logged if r["kind"] == "replicas"] == [
        (4, after[4]), (9, after[9])]


def test_watched_loop_digests_after_the_optimizer_step(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tel = Telemetry(tmp_path / "run", heartbeat_interval=3600, exchange_every=0)
    tel.start()
    tel.watch(model, opt)
    tel.check_replicas(model, every=3, tolerance=1e-6)
    for step in range(6):
        model(torch.ones(2, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 2:
            after_step_2 = _hex(model)
    tel.close()
    status = json.loads((tmp_path / "run" / "status" / "rank-00000.json").read_text())
    assert [d["step"] for d in status["replicas"]] == [2, 5]
    assert status["replicas"][0]["bits"] == after_step_2
    assert status["replicas"][1]["norm"] > 0 and status["replicas"][1]["tolerance"] == 1e-6


# ---------------------------------------------------------------- the agent's vote
def _d(step, bits, group="0", norm=None, tolerance=None):
    return {"step": step, "group": group, "bits": bits, "norm": norm, "tolerance": tolerance}


A, B, C = "a" * 16, "b" * 16, "c" * 16


def test_vote_names_the_minority_and_not_one_of_two():
    assert vote({0: _d(1, A), 1: _d(1, A), 2: _d(1, A)}) == ([], True)
    assert vote({0: _d(1, A), 1: _d(1, B), 2: _d(1, A)}) == ([1], True)
    assert vote({0: _d(1, A), 1: _d(1, B)}) == ([0, 1], False)
    assert vote({0: _d(1, A), 1: _d(1, A), 2: _d(1, B), 3: _d(1, B)}) == ([0, 1, 2, 3], False)
    assert vote({0: _d(1, A), 1: _d(1, B), 2: _d(1, C)}) == ([0, 1, 2], False)
    assert suspects_label([1], True) == "1"
    assert suspects_label([0, 1], False) == "one of 0,1"
    assert suspects_label(list(range(10)), True) == "0,1,2,3,4,5,6,7,+2"


def test_tolerance_mode_compares_norms():
    near = {r: _d(1, f"{r:016x}", norm=100.0 + r * 1e-5, tolerance=1e-6) for r in range(3)}
    assert vote(near) == ([], True)
    near[2] = _d(1, A, norm=100.5, tolerance=1e-6)
    assert vote(near) == ([2], True)


def test_digests_drop_what_is_malformed():
    good = _d(3, A, group=2)
    raw = [good, {"step": True, "bits": A}, {"step": 1, "bits": "xyz"}, "junk",
           {"step": 1, "bits": A, "group": [1]}, {"step": -1, "bits": A}]
    assert digests(raw) == [{**good, "group": "2"}]
    assert digests("nope") == [] and digests(None) == []


def _ranks(per_rank, state="running"):
    return [{"rank": r, "state": state, "replicas": [_d(s, b) for s, b in ds]}
            for r, ds in per_rank.items()]


def test_judge_needs_two_consecutive_digests_and_waits_for_every_rank():
    judge = ReplicaJudge()
    v = judge.update("j", _ranks({0: [(9, A)], 1: [(9, A)], 2: [(9, A)]}))["0"]
    assert v.last_step == 9 and v.suspects == [] and v.agreeing == 3
    # rank 2 has not published step 19 yet: nothing compared
    v = judge.update("j", _ranks({0: [(9, A), (19, B)], 1: [(9, A), (19, B)], 2: [(9, A)]}))["0"]
    assert v.last_step == 9
    v = judge.update("j", _ranks({0: [(19, B)], 1: [(19, B)], 2: [(19, C)]}))["0"]
    assert (v.suspects, v.streak, v.mismatch) == ([2], 1, {0: 0, 1: 0, 2: 1})
    # the same step seen again is not a second observation
    v = judge.update("j", _ranks({0: [(19, B)], 1: [(19, B)], 2: [(19, C)]}))["0"]
    assert v.streak == 1
    v = judge.update("j", _ranks({0: [(29, A)], 1: [(29, A)], 2: [(29, C)]}))["0"]
    assert (v.suspects, v.streak, v.mismatch[2]) == ([2], 2, 2)
    v = judge.update("j", _ranks({0: [(39, A)], 1: [(39, A)], 2: [(39, A)]}))["0"]
    assert (v.suspects, v.streak, v.mismatch[2]) == ([], 0, 0)
    # restarted from an earlier checkpoint: compared afresh
    v = judge.update("j", _ranks({0: [(9, A)], 1: [(9, A)], 2: [(9, A)]}))["0"]
    assert v.last_step == 9 and v.streak == 0


def test_judge_two_ranks_name_no_single_rank():
    judge = ReplicaJudge()
    judge.update("j", _ranks({0: [(9, A)], 1: [(9, B)]}))
    v = judge.update("j", _ranks({0: [(19, A)], 1: [(19, B)]}))["0"]
    assert (v.suspects, v.majority, v.streak, v.mismatch) == ([0, 1], False, 2, {0: 0, 1: 0})


def test_judge_compares_without_a_dead_rank():
    judge = ReplicaJudge()
    ranks = _ranks({0: [(9, A), (19, A)], 1: [(9, A), (19, A)]})
    ranks.append({"rank": 2, "state": "failed", "replicas": [_d(9, A)]})
    v = judge.update("j", ranks)["0"]
    assert v.last_step == 19 and v.compared == 2


def test_digest_bits_are_the_float_bits_summed():
    """The digest of one float32 tensor is its bit patterns' sum (weight 1)."""
    values = [1.5, -2.25, 3.0]
    expected = sum(struct.unpack("<i", struct.pack("<f", v))[0] for v in values)
    assert digest([torch.tensor(values)])[0].item() == expected


# ---------------------------------------------------------------- the agent's collector
def test_collector_names_the_odd_rank_from_status_files_after_two_digests(tmp_path):
    """Real status files through the ranks collector: three replicas, rank 1 diverges at
    step 19; one odd digest is no verdict, the second names rank 1."""
    import os

    from agent_helpers import collector, make_ctx, publish, samples, value, write_status
    from trainwatch.rundir.run_dir import RunDir

    run = RunDir(tmp_path / "run").create()
    ctx = make_ctx([run.root])
    ranks, replicas = collector(ctx, "ranks"), collector(ctx, "replicas")

    def look(per_rank):
        for rank, ds in per_rank.items():
            write_status(run, rank, os.getpid(), replicas=[_d(s, b) for s, b in ds])
        publish(ctx, "ranks", ranks.collect())
        return replicas.collect()

    result = look({0: [(9, A)], 1: [(9, A)], 2: [(9, A)]})
    assert value(result, "trainwatch_replica_digest_ranks_agreeing", group="0") == 3
    assert not samples(result, "trainwatch_replica_divergence_digests")
    result = look({0: [(9, A), (19, B)], 1: [(9, A), (19, C)], 2: [(9, A), (19, B)]})
    assert value(result, "trainwatch_replica_divergence_digests", suspects="1") == 1
    result = look({0: [(19, B), (29, A)], 1: [(19, C), (29, C)], 2: [(19, B), (29, A)]})
    assert value(result, "trainwatch_replica_divergence_digests", suspects="1") == 2
    assert value(result, "trainwatch_replica_digest_mismatch", rank=1) == 2
    assert value(result, "trainwatch_replica_digest_mismatch", rank=0) == 0
    assert value(result, "trainwatch_replica_digest_step", group="0") == 29
    assert value(result, "trainwatch_replica_digest_value", rank=1) == int(C, 16) & ((1 << 52) - 1)
    assert value(result, "trainwatch_replica_digest_value_step", rank=1) == 29
    assert result.data["jobs"]["exp"]["0"]["suspects"] == [1]


# ---------------------------------------------------------------- the rollback's choice
def _log(run, rank, entries, time0=1000.0):
    from trainwatch.rundir.atomic import append_jsonl
    for i, (step, bits) in enumerate(entries):
        append_jsonl(run.metrics_file(rank), {"v": 1, "kind": "replicas", "time": time0 + i,
                                              "rank": rank, **_d(step, bits, group=0)})


def test_rollback_finds_the_newest_agreeing_step_before_a_confirmed_divergence(tmp_path):
    from trainwatch.control.replica_rollback import find_divergence
    from trainwatch.rundir.run_dir import RunDir

    run = RunDir(tmp_path / "run").create()
    _log(run, 0, [(4, A), (9, B), (14, C), (19, A)])
    _log(run, 1, [(4, A), (9, B), (14, A), (19, B)])
    _log(run, 2, [(4, A), (9, B), (14, C), (19, A)])
    found = find_divergence(run)
    assert (found.first_odd_step, found.last_agreeing_step, found.suspects, found.digests) == (
        14, 9, [1], 2)
    assert found.clean_checkpoint_step == 10
    # logged before the last rollback: judged no more
    assert find_divergence(run, since=2000.0).digests == 0
    # one odd digest alone is not confirmed
    run2 = RunDir(tmp_path / "run2").create()
    for rank in range(3):
        _log(run2, rank, [(4, A), (9, C if rank == 2 else B), (14, A)])
    assert find_divergence(run2).digests == 1


def test_any_replicas_field_is_read_or_dropped_never_raised():
    """A status is the rank's to write and anyone's to corrupt: whatever its ``replicas``
    field holds, the agent keeps well-formed digests only and votes without raising."""
    from hypothesis import given, settings, strategies as st

    scalars = st.none() | st.booleans() | st.integers(-2, 2**70) | st.floats() | st.text(max_size=20)
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(st.sampled_from(
                              ["step", "bits", "group", "norm", "tolerance", "x"]), inner,
                              max_size=6), max_leaves=30)
    digest_like = st.fixed_dictionaries({"step": st.integers(0, 30), "bits": st.sampled_from([A, B])},
                                        optional={"group": scalars, "norm": scalars,
                                                  "tolerance": scalars})

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.lists(digest_like, max_size=5) | values, min_size=1, max_size=4))
    def check(fields):
        judge = ReplicaJudge()
        ranks = []
        for rank, field in enumerate(fields):
            kept = digests(field)
            assert all(isinstance(d["step"], int) and len(d["bits"]) == 16 for d in kept)
            ranks.append({"rank": rank, "state": "running", "replicas": kept})
        for verdict in judge.update("j", ranks).values():
            assert verdict.streak >= 0 and set(verdict.suspects) <= set(range(len(fields)))

    check()


def test_rollback_marks_a_node_for_preflight_only_for_a_rank_named_alone(tmp_path):
    """A majority's suspect gets RUN_DIR/suspects/<node>.json; a tie ("one of 0,1") would
    fail every replica's node, so it marks none."""
    from trainwatch.control.actions import ActionRunner, Policy
    from trainwatch.control.replica_rollback import Divergence
    from trainwatch.host.suspects import suspects_of

    runner = ActionRunner(tmp_path / "run", None, Policy(), job="exp1", clock=lambda: 1000.0)
    named = Divergence(24, 19, [1], True, 2)
    (path,) = runner._mark_suspects(named, [{"rank": 1, "node": "n1"}], 20,
                                    "TrainingReplicaDivergence")
    (found, record), = suspects_of(runner.run.suspects_dir, "n1")[0]
    assert str(found) == path and record["ranks"] == [1] and record["run"] == "exp1"
    assert record["time"] == 1000.0 and record["evidence"]["clean_checkpoint_step"] == 20
    assert suspects_of(runner.run.suspects_dir, "n2") == ([], [])
    tie = Divergence(24, 19, [0, 1], False, 2)
    assert runner._mark_suspects(tie, [{"rank": 0, "node": "n2"}, {"rank": 1, "node": "n3"}],
                                 20, "TrainingReplicaDivergence") == []
