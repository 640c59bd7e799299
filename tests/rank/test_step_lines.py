"""The heartbeat writes a step's metrics-log line as text, not through a dict and json's
encoder (~15 us a step on the thread that holds the GIL): the bytes must stay json's."""

import json
import math
from pathlib import Path

import pytest
import torch

from trainwatch.rank import step_lines
from trainwatch.rank.step_lines import ENCODER, StepLines, as_dict, resolve
from trainwatch.rank.telemetry import Telemetry
from trainwatch.rundir.run_dir import RunDir


class Tokens(int):
    """An int subclass json writes as an int (and a bool is one json writes as true)."""


def _pending(step=7, phases=None, values=None):
    phases = {"data": 315, "forward": 2_720_000, "backward": 266, "optimizer": 291} \
        if phases is None else phases
    values = {"loss": 2.345678, "grad_norm": torch.tensor(0.5), "lr": 1e-3, "tokens": 4096,
              "samples": 1} if values is None else values
    return (step, 1796590520.3598783, 7_135_001, phases, {}, values)


def _both(p, memory=None, fpt=None, peak=None):
    memory = {"memory_bytes": 237563904, "memory_kind": "rss"} if memory is None else memory
    lines = StepLines(rank=3)
    r = resolve(p)
    return (_outcome(lambda: lines.text(r, memory, lines.memory_tail(memory), fpt, peak)),
            _outcome(lambda: ENCODER.encode(as_dict(r, 3, memory, fpt, peak)) + "\n"))


def _outcome(write):
    """The line, or the error that writing it raises (the same either way)."""
    try:
        return write()
    except (TypeError, ValueError) as exc:
        return type(exc), str(exc)


@pytest.mark.parametrize("values", [
    {},
    {"loss": math.nan, "grad_norm": math.inf, "lr": -math.inf, "x": -0.0},
    {"tokens": Tokens(4096), "samples": True, "flag": False, "none": None, "big": 10**30},
    {"note": 'a "quoted" \\ line\n', "ünï": "☃", "tensor": torch.tensor([1.0, 2.0])},
    {"skipped": [1, 2], "also": {"a": 1}, "tokens": 0, "samples": 2.5},
    {"mfu": 0.5, "loss": 1.0},            # a fixed key recorded: its place in the dict
    {"step": "mine", "time": 1, "memory_kind": "x"},
])
def test_a_line_is_the_bytes_json_writes_for_its_dict(values):
    text, reference = _both(_pending(values=values), fpt=6e5, peak=1e12)
    assert text == reference
    assert json.dumps(json.loads(text), separators=(",", ":")) + "\n" == text


@pytest.mark.parametrize("phases", [{}, {"forward": 1}, {1: 5, None: 6, "data": 0},
                                    {"eval \"x\"": 9, "data": 10**12}])
def test_odd_phase_names_and_steps_are_written_as_json_writes_them(phases):
    for step in (0, -1, 2**63, Tokens(5)):
        text, reference = _both(_pending(step=step, phases=phases))
        assert text == reference


def test_values_json_cannot_hold_fail_as_the_dict_did():
    for p in (_pending(step=object()), _pending(values={"tokens": "many"})):  # tokens / seconds
        text, reference = _both(p)
        assert text == reference and text[0] is TypeError


def test_property_lines_match_json(tmp_path):
    from hypothesis import given, settings, strategies as st

    # fixed odd strings, not st.text(): its character tables cost seconds to build
    words = st.sampled_from(["", "a", 'q"uote', "back\\slash", "new\nline", "\x00", "ünï", "☃",
                             "\U0001f600", "data", "loss", "tokens", "samples"])
    scalars = st.floats() | st.integers() | st.booleans() | st.none() | words
    keys = words | st.sampled_from(sorted(step_lines.FIXED))

    @settings(max_examples=20, deadline=None)
    @given(st.dictionaries(keys, scalars, max_size=6),
           st.dictionaries(words, st.integers(0, 10**13), max_size=4),
           st.integers(0, 10**10), st.floats(allow_nan=False, min_value=0, max_value=1e12))
    def check(values, phases, step_ns, peak):
        p = (5, 1.5e9 + step_ns / 7, step_ns, phases, {}, values)
        text, reference = _both(p, fpt=3.0, peak=peak or None)
        assert text == reference

    check()


def test_a_flush_does_not_run_json_encoder_per_step(tmp_path, monkeypatch):
    """Load-proof stand-in for its cost: json's encoder (a C encoder made per call) ran once
    per step line; now the keys are encoded once and a step's values formatted alone."""
    tel = Telemetry(tmp_path / "run", rank=0, world_size=1, flops_per_token=1.0,
                    heartbeat_interval=3600).start()
    try:
        loss = torch.tensor(2.5)
        for n in range(200):
            with tel.step(n) as record:
                for name in ("data", "forward", "backward", "optimizer"):
                    with tel.phase(name):
                        pass
                record.record(loss=loss, grad_norm=loss * 2, lr=1e-3 * n, tokens=4096, samples=1)
        made = []
        real = json.encoder.c_make_encoder
        monkeypatch.setattr(json.encoder, "c_make_encoder", lambda *a: made.append(1) or real(*a))
        tel._flush()
        monkeypatch.undo()
        text = Path(RunDir(tmp_path / "run").metrics_file(0)).read_text()
        steps = [json.loads(line) for line in text.splitlines()]
        assert [s["step"] for s in steps if s["kind"] == "step"] == list(range(200))
        assert steps[-1] == {**tel.snapshot()["metrics"]}
        assert steps[-1]["loss"] == 2.5 and steps[-1]["grad_norm"] == 5.0
        assert len(made) <= 2, f"json's encoder made {len(made)} times for 200 steps"
    finally:
        tel.close()
