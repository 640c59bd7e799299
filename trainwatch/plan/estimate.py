"""A whole plan from a spec: model, memory and the verdict per device type, compute,
storage, reliability. The JSON shape is documented in docs/plan.md."""

from __future__ import annotations

import dataclasses
from typing import Any

from trainwatch.plan.compute import compute
from trainwatch.plan.devices import DEVICE_TYPES, HEADROOM, verdict
from trainwatch.plan.memory import memory
from trainwatch.plan.model import model_params
from trainwatch.plan.reliability import reliability
from trainwatch.plan.sheet import Sheet
from trainwatch.plan.spec import CHINCHILLA_TOKENS_PER_PARAM, PlanSpec, trainer_mode
from trainwatch.plan.storage import storage

FORMAT = "trainwatch.plan"
VERSION = 1


def make_plan(spec: PlanSpec) -> dict[str, Any]:
    """With neither tokens nor steps, a run trains on 20 tokens per parameter
    (Chinchilla-optimal, Hoffmann et al. 2022)."""
    sheet = Sheet()
    params, flop_params = model_params(spec, sheet)
    if spec.tokens is None and spec.steps is None:
        spec = dataclasses.replace(spec, tokens=float(CHINCHILLA_TOKENS_PER_PARAM * params))
    need = memory(spec, params, sheet)
    recompute_need = (need - sheet.value("memory", "activations_bytes")
                      + sheet.value("memory", "activations_with_recompute_bytes"))
    step_seconds = compute(spec, flop_params, sheet)
    storage(spec, params, sheet)
    reliability(spec, sheet.value("compute", "hours"), step_seconds,
                sheet.value("storage", "checkpoint_bytes"), sheet)
    devices = [{"device_type": d.key, "name": d.name, "memory_bytes": d.memory_bytes,
                "usable_bytes": (1 - HEADROOM) * d.memory_bytes,
                "verdict": verdict(need, d.memory_bytes),
                "verdict_with_recompute": verdict(recompute_need, d.memory_bytes)}
               for d in DEVICE_TYPES.values()]
    return {"format": FORMAT, "version": VERSION, "spec": spec.as_dict(),
            "trainer_mode": trainer_mode(spec),
            **sheet.values(), "devices": devices, "headroom": HEADROOM,
            "explain": sheet.explain()}
