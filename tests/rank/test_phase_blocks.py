"""Phase blocks by kind (CPU, GPU, ``eval``), chosen once per name so that the plain kind's
boundary does no more than it must (issue #38's per-step cost); what they record is what
one block for every kind recorded."""

import itertools

from trainwatch.rank.recorder import (CudaEvalPhaseBlock, CudaPhaseBlock, EvalPhaseBlock,
                                      LoopRecorder, PhaseBlock, PhaseBlocks)


def _loop(is_cuda=False):
    state = {"step": None, "counters": {"steps_total": 0, "pending_dropped_total": 0}}
    loop = LoopRecorder(state, rank=0, is_cuda=is_cuda, exchange_every=0,
                        collective_phases=("backward",), max_pending=10, guard=lambda fn: fn(),
                        count_error=lambda problem: None, exchange=lambda *a: None)
    return loop, PhaseBlocks(loop)


def _fake_events(loop):
    """CUDA events without a GPU: a start is a number, an end is logged as (name, start)
    in the step's events, as the real pair is."""
    numbers, ends = itertools.count(), []
    loop.cuda_event_pair_start = lambda: next(numbers)

    def end(name, start):
        ends.append((name, start))
        loop.step_cuda_events.setdefault(name, []).append((start, "end"))
    loop.cuda_event_pair_end = end
    return ends


def test_each_name_gets_its_kind_once_and_a_disabled_telemetry_one_no_op_block():
    loop, blocks = _loop()
    assert type(blocks["forward"]) is PhaseBlock and blocks["forward"] is blocks["forward"]
    assert type(blocks["eval"]) is EvalPhaseBlock
    gpu_loop, gpu_blocks = _loop(is_cuda=True)
    assert type(gpu_blocks["forward"]) is CudaPhaseBlock
    assert type(gpu_blocks["eval"]) is CudaEvalPhaseBlock
    off = PhaseBlocks(None)
    assert off["forward"] is off["eval"] is off.null
    with off["forward"]:
        pass


def test_names_past_the_kept_ones_are_still_timed():
    loop, blocks = _loop()
    loop.begin_step(0)
    names = [f"made-up-{i}" for i in range(PhaseBlocks.KEEP + 44)]
    for name in names:
        with blocks[name]:
            pass
    assert len(blocks) == PhaseBlocks.KEEP and set(loop.step_phase_ns) == set(names)


def test_gpu_blocks_pair_their_events_by_nesting_and_eval_between_steps_is_a_record():
    loop, blocks = _loop(is_cuda=True)
    ends = _fake_events(loop)
    loop.begin_step(0)
    with blocks["forward"]:
        with blocks["data"]:
            assert loop.phase_now[0] == "data"
    with blocks["eval"]:  # inside a step: part of it, no record of its own
        pass
    loop.end_step(0, {})
    assert ends == [("data", 1), ("forward", 0), ("eval", 2)]
    assert loop.phase_now[0] == "idle" and loop.phase_stack == [] == loop.cuda_starts
    with blocks["eval"]:
        pass
    assert ends[-1] == ("eval", 3) and loop.phase_now[0] == "idle"
    step, evaluation = loop.pending
    assert set(step[3]) == {"forward", "data", "eval"} and set(step[4]) == set(step[3])
    assert evaluation["kind"] == "eval" and evaluation["seconds"] >= 0


def test_an_eval_between_steps_on_a_cpu_is_a_record_of_the_time_it_took():
    loop, blocks = _loop()
    with blocks["eval"]:
        pass
    (evaluation,) = loop.pending
    assert evaluation["seconds"] == round(loop.step_phase_ns["eval"] / 1e9, 6)
    loop.begin_step(0)  # the eval's time belongs to no step
    with blocks["eval"]:
        pass
    loop.end_step(0, {})
    assert len(loop.pending) == 2 and set(loop.pending[1][3]) == {"eval"}


def test_a_step_without_device_events_shares_no_dict_with_the_next():
    """The loop keeps its empty events dict when a step timed none; the pending record
    must not be that dict, or the next step's events would show up in it."""
    loop, blocks = _loop(is_cuda=True)
    _fake_events(loop)
    loop.begin_step(0)
    loop.end_step(0, {})
    loop.begin_step(1)
    with blocks["forward"]:
        pass
    loop.end_step(1, {})
    first, second = loop.pending
    assert first[4] == {} and set(second[4]) == {"forward"}
    assert first[3] == {} and set(second[3]) == {"forward"}
