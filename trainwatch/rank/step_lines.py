"""A finished step's line in the metrics log, and its dict for the status's ``metrics``.

The heartbeat thread turns every step the loop finished into a line. Built as a dict and
handed to json's encoder, that cost ~15 us a step on the thread that holds the GIL while it
works (at a 3 ms step the loop waits for it). So a line is written as text: its keys and
fixed parts are encoded once, and only the step's own values are formatted, each as json
writes it (a float's repr; NaN and the infinities json's way; anything else through json's
encoder). The bytes are the dict's under json (tests/rank/test_step_lines.py compares
both); a step that records a key the line fixes (``step``, ``mfu``, ...), whose place in
the dict its recorded value takes, is written through the dict.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from trainwatch.rank.recorder import scalar

# json.dumps builds a new encoder on every call that passes options; these reuse one.
ENCODER = json.JSONEncoder(separators=(",", ":"))
_encode = ENCODER.encode

# The keys a step line sets itself; a recorded value under one of them takes its place.
FIXED = frozenset({"v", "kind", "step", "time", "rank", "step_time_seconds", "phase_seconds",
                   "data_wait_seconds", "tokens_per_second", "samples_per_second", "mfu",
                   "memory_bytes", "memory_kind"})

# (step, end time, step seconds, phase seconds, data wait seconds, recorded values read)
Resolved = tuple[Any, float, float, dict[Any, Any], float, dict[str, Any]]


def resolve(p: tuple) -> Resolved:
    """A pending step with its tensors read (the only place they are) and its times in
    seconds (whole nanoseconds: the clock's resolution, and short to print)."""
    step, end_time, step_ns, phase_ns, cuda_events, recorded = p
    phases = {name: ns / 1e9 for name, ns in phase_ns.items()}
    for name, pairs in cuda_events.items():
        # Device time for GPU work; waiting here blocks only this thread.
        pairs[-1][1].synchronize()
        phases[name] = sum(s.elapsed_time(e) for s, e in pairs) / 1000.0
    values = {key: scalar(value) if isinstance(value, torch.Tensor) else value
              for key, value in recorded.items()}
    # The data phase's own float when it was not timed on the device: its text is reused.
    data_wait = phases["data"] if "data" in phase_ns and "data" not in cuda_events else (
        phase_ns.get("data", 0) / 1e9)
    return step, end_time, step_ns / 1e9, phases, data_wait, values


def nonfinite(values: dict[str, Any]) -> tuple[bool, bool]:
    """Whether the recorded loss, and the grad norm, are floats that are not finite."""
    loss, grad_norm = values.get("loss"), values.get("grad_norm")
    return (isinstance(loss, float) and not math.isfinite(loss),
            isinstance(grad_norm, float) and not math.isfinite(grad_norm))


def _rates(step_seconds: float, values: dict[str, Any], flops_per_token: float | None,
           peak_flops: float | None) -> tuple[Any, Any, Any]:
    """tokens_per_second, samples_per_second (None: not in the line) and mfu."""
    tokens, samples = values.get("tokens"), values.get("samples")
    per_token = per_sample = mfu = None
    if step_seconds > 0:
        if tokens:
            per_token = tokens / step_seconds
        if samples:
            per_sample = samples / step_seconds
    if tokens and flops_per_token and peak_flops and step_seconds > 0:
        mfu = tokens * flops_per_token / step_seconds / peak_flops
    return per_token, per_sample, mfu


def _written(value: Any) -> bool:
    return value is None or isinstance(value, (int, float, str))  # what JSON can hold


def as_dict(r: Resolved, rank: int, memory: dict[str, Any], flops_per_token: float | None,
            peak_flops: float | None) -> dict[str, Any]:
    """The step's line as a dict (the status's ``metrics``; the text's reference)."""
    step, end_time, step_seconds, phases, data_wait, values = r
    line: dict[str, Any] = {"v": 1, "kind": "step", "step": step, "time": end_time,
                            "rank": rank, "step_time_seconds": step_seconds,
                            "phase_seconds": phases, "data_wait_seconds": data_wait}
    for key, value in values.items():
        if _written(value):
            line[key] = value
    per_token, per_sample, mfu = _rates(step_seconds, values, flops_per_token, peak_flops)
    if per_token is not None:
        line["tokens_per_second"] = per_token
    if per_sample is not None:
        line["samples_per_second"] = per_sample
    line["mfu"] = mfu
    line.update(memory)
    return line


def _value(value: Any) -> str:
    """``value`` as json writes it inside a line."""
    if type(value) is float:
        return repr(value) if value - value == 0 else _encode(value)  # NaN, infinities
    if type(value) is int:
        return repr(value)
    if value is None:
        return "null"
    return _encode(value)


class StepLines:
    """Writes one rank's step lines; keeps the encoded keys and fixed parts."""

    def __init__(self, rank: int):
        self.rank = rank
        self.head = '{"v":1,"kind":"step","step":'
        self.rank_part = f',"rank":{_encode(rank)},"step_time_seconds":'
        self.keys: dict[Any, str] = {}  # name -> '"name":'

    def _key(self, name: Any) -> str:
        key = self.keys.get(name)
        if key is None:
            key = _encode(name) + ":" if type(name) is str else _encode({name: 0})[1:-3] + ":"
            if len(self.keys) < 1024:  # names made up on the fly are not kept
                self.keys[name] = key
        return key

    def memory_tail(self, memory: dict[str, Any]) -> str:
        """The line's end, the same for every step of one flush: the memory reading."""
        return "".join(f",{self._key(k)}{_value(v)}" for k, v in memory.items()) + "}\n"

    def text(self, r: Resolved, memory: dict[str, Any], tail: str,
             flops_per_token: float | None, peak_flops: float | None) -> str:
        """The step's line, newline included (``tail``: ``memory_tail(memory)``)."""
        step, end_time, step_seconds, phases, data_wait, values = r
        if not FIXED.isdisjoint(values):  # a recorded value in a fixed key's place
            return _encode(as_dict(r, self.rank, memory, flops_per_token, peak_flops)) + "\n"
        keys, key, data_text, timed = self.keys, self._key, None, []
        for name, seconds in phases.items():
            # a float's repr inline: the line's floats are most of its cost
            text = repr(seconds) if type(seconds) is float and seconds - seconds == 0 else (
                _value(seconds))
            if seconds is data_wait:
                data_text = text
            timed.append((keys.get(name) or key(name)) + text)
        parts = [self.head, _value(step), ',"time":', _value(end_time), self.rank_part,
                 repr(step_seconds), ',"phase_seconds":{', ",".join(timed),
                 '},"data_wait_seconds":', data_text or _value(data_wait)]
        append = parts.append
        for name, value in values.items():
            kind = type(value)
            if kind is float:
                append(f",{keys.get(name) or key(name)}"
                       f"{repr(value) if value - value == 0 else _encode(value)}")
            elif kind is int:
                append(f",{keys.get(name) or key(name)}{value!r}")
            elif _written(value):
                append(f",{keys.get(name) or key(name)}{_value(value)}")
        per_token, per_sample, mfu = _rates(step_seconds, values, flops_per_token, peak_flops)
        if per_token is not None:
            append(f',"tokens_per_second":{_value(per_token)}')
        if per_sample is not None:
            append(f',"samples_per_second":{_value(per_sample)}')
        append(f',"mfu":{_value(mfu)}{tail}')
        return "".join(parts)
