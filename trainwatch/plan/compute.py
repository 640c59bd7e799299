"""Training FLOPs, time at an assumed MFU, device-hours and cost.

FLOPs per token are the trainer's own (PaLM appendix B): 6·N for the weights' forward
and backward plus 12·L·h·s for attention. MFU counts these model FLOPs only, so
recomputation shows up as a lower MFU, not as more FLOPs; 40 % is typical of large
dense runs (Llama 3 405B reports 38-43 % on H100s).
"""

from __future__ import annotations

from trainwatch.plan.devices import device_type
from trainwatch.plan.sheet import Sheet
from trainwatch.plan.spec import PlanSpec
from trainwatch.rank.flops import transformer_flops_per_token


def compute(spec: PlanSpec, flop_params: int, sheet: Sheet) -> float | None:
    """Adds the compute section; returns seconds per step (None without a peak FLOP/s)."""
    per_token = sheet.add(
        "compute", "flops_per_token",
        transformer_flops_per_token(flop_params, spec.layers, spec.heads,
                                    spec.hidden // spec.heads, spec.seq), "FLOP",
        "6·N + 12·layers·h·seq", N=flop_params, layers=spec.layers, h=spec.hidden, seq=spec.seq)
    tokens = sheet.add("compute", "tokens", spec.total_tokens, "tokens",
                       "given (--tokens; without --tokens or --steps: 20 x params, "
                       "Chinchilla-optimal)" if spec.tokens is not None
                       else "steps x micro_batch x grad_accum x seq x data-parallel degree",
                       steps=spec.steps, micro_batch=spec.micro_batch,
                       grad_accum=spec.grad_accum, seq=spec.seq, dp=spec.dp)
    total = sheet.add("compute", "training_flops", per_token * tokens, "FLOP",
                      "flops_per_token x tokens", flops_per_token=per_token, tokens=tokens)
    peak = spec.peak_flops or device_type(spec.device_type).peak_flops
    if peak is None:
        for key in ("step_seconds", "hours", "device_hours", "cost"):
            sheet.add("compute", key, None, "", f"unknown: no peak FLOP/s for {spec.device_type} "
                      "(give --peak-flops)")
        return None
    rate = spec.devices * peak * spec.mfu
    step = sheet.add("compute", "step_seconds", per_token * spec.tokens_per_step / rate, "s",
                     "flops_per_token x tokens_per_step / (devices x peak x MFU)",
                     tokens_per_step=spec.tokens_per_step, devices=spec.devices,
                     peak_flops=peak, mfu=spec.mfu)
    hours = sheet.add("compute", "hours", total / rate / 3600, "h",
                      "training_flops / (devices x peak x MFU) / 3600", devices=spec.devices,
                      peak_flops=peak, mfu=spec.mfu)
    device_hours = sheet.add("compute", "device_hours", hours * spec.devices, "device-h",
                             "hours x devices", devices=spec.devices)
    price = spec.price_per_device_hour
    sheet.add("compute", "cost", None if price is None else device_hours * price, "price",
              "device_hours x price" if price is not None else "no --price given",
              price_per_device_hour=price)
    return step
