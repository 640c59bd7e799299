"""Memory per device: weights, gradients, optimizer state, activations, temporary buffers.

Model state follows the ZeRO paper (Rajbhandari et al. 2020): mixed-precision Adam
keeps 16 bytes per parameter (2 weights + 2 gradients + 12 for the fp32 master copy
and two moments); ZeRO stage 1/2/3 (FSDP FULL_SHARD is stage 3) divide the optimizer
state, then the gradients, then the weights by the sharding degree. Tensor and
pipeline parallelism divide the model first.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models"): a layer keeps ``s·b·h·(34 + 5·a·s/h)`` bytes in 16-bit
with dropout; the ``5·a·s/h`` part is the attention matrix, which flash attention
never stores (it keeps the output instead: 17 tensors of s·b·h). Tensor parallelism
with sequence parallelism divides it by t; full recomputation keeps only each layer's
input; with 1F1B pipelining the first stage holds ``p`` micro-batches of ``L/p``
layers. The measured check: tests/plan/test_plan_measured.py.
"""

from __future__ import annotations

from trainwatch.plan.model import embedding_params, layer_params, position_params
from trainwatch.plan.sheet import Sheet
from trainwatch.plan.spec import PlanSpec

# bytes per parameter: weights, gradients, fp32 master copy, one optimizer moment
PRECISION_BYTES = {
    "fp32": (4, 4, 0, 4),
    "amp-bf16": (4, 4, 0, 4),     # fp32 weights, bf16 autocast: compute copies are temporary
    "bf16-mixed": (2, 2, 4, 4),   # Megatron / DeepSpeed mixed precision
    "bf16": (2, 2, 0, 2),         # everything bf16, no master copy
}
MOMENTS = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}
STAGE = {"none": 0, "optimizer": 1, "gradients": 2, "full": 3}


def activation_element_bytes(spec: PlanSpec) -> int:
    return 4 if spec.precision == "fp32" else 2


def layer_activation_bytes(spec: PlanSpec, recompute: str) -> float:
    """What one layer keeps for backward, for one micro-batch, on one device."""
    e, t = activation_element_bytes(spec), spec.tp
    sbh = spec.seq * spec.micro_batch * spec.hidden
    drop = 1 if spec.dropout else 0
    if recompute == "full":
        return e * sbh / t
    kept = sbh * (17 * e + 2 * drop)
    if not spec.flash_attention and recompute == "none":
        kept = sbh * (16 * e + 2 * drop) + spec.heads * spec.seq ** 2 * spec.micro_batch * (
            e + drop * (1 + e))
    return kept / t


def memory(spec: PlanSpec, params: int, sheet: Sheet) -> float:
    """Adds the memory section; returns the bytes one device needs (busiest device)."""
    w, g, master, moment = PRECISION_BYTES[spec.precision]
    stage, shard = STAGE[spec.sharding], spec.shard_group
    mp = spec.tp * spec.pp
    n = params / mp
    state_inputs = dict(params=params, tp=spec.tp, pp=spec.pp, shard_degree=shard,
                        sharding=spec.sharding)
    weights = sheet.add("memory", "weights_bytes", n * w / (shard if stage >= 3 else 1),
                        "bytes", f"params / (tp·pp) x {w} B"
                        + (" / shard_degree" if stage >= 3 else ""), **state_inputs)
    grads = sheet.add("memory", "gradients_bytes", n * g / (shard if stage >= 2 else 1),
                      "bytes", f"params / (tp·pp) x {g} B"
                      + (" / shard_degree" if stage >= 2 else ""), **state_inputs)
    per_param = master + MOMENTS[spec.optimizer] * moment
    optim = sheet.add("memory", "optimizer_bytes", n * per_param / (shard if stage >= 1 else 1),
                      "bytes", f"params / (tp·pp) x ({master} B master + "
                      f"{MOMENTS[spec.optimizer]} moments x {moment} B)"
                      + (" / shard_degree" if stage >= 1 else ""),
                      optimizer=spec.optimizer, precision=spec.precision, **state_inputs)

    e = activation_element_bytes(spec)
    in_flight = min(spec.pp, spec.grad_accum)
    stage_layers = spec.layers // spec.pp
    sbh = spec.seq * spec.micro_batch * spec.hidden
    sbv = spec.seq * spec.micro_batch * spec.vocab
    head = (2 * e * sbh + sbv * (e + 4)) / spec.tp  # final norm, head input, logits, fp32 loss
    act_inputs = dict(s=spec.seq, b=spec.micro_batch, h=spec.hidden, a=spec.heads,
                      layers_on_stage=stage_layers, micro_batches_in_flight=in_flight,
                      tp=spec.tp, element_bytes=e, flash_attention=spec.flash_attention,
                      dropout=spec.dropout, vocab=spec.vocab)
    per_layer = {r: layer_activation_bytes(spec, r) for r in ("none", "selective", "full")}
    layer_formula = {
        "none": "s·b·h·(17·e + 2·dropout)/tp" if spec.flash_attention else
                "(s·b·h·(16·e + 2·dropout) + a·s²·b·(e + dropout·(1 + e)))/tp",
        "selective": "s·b·h·(17·e + 2·dropout)/tp",
        "full": "e·s·b·h/tp (+ one layer's activations while it is recomputed)",
    }
    head_formula = (" + (2·e·s·b·h + s·b·vocab·(e + 4))/tp (final norm, head, logits, "
                    "fp32 loss)")

    def activations(recompute: str) -> float:
        total = stage_layers * in_flight * per_layer[recompute] + head
        if recompute == "full":
            total += per_layer["none"]
        return total

    sheet.add("memory", "activations_without_recompute_bytes", activations("none"), "bytes",
              f"layers_on_stage x micro_batches_in_flight x {layer_formula['none']}"
              + head_formula, **act_inputs)
    sheet.add("memory", "activations_with_recompute_bytes", activations("full"), "bytes",
              f"layers_on_stage x micro_batches_in_flight x {layer_formula['full']}"
              + head_formula, **act_inputs)
    act = sheet.add("memory", "activations_bytes", activations(spec.recompute), "bytes",
                    f"the {spec.recompute!r} recomputation figure", recompute=spec.recompute)

    lp = layer_params(spec) / spec.tp
    temp_inputs = dict(logits_gradient=sbv * 4 / spec.tp)
    temp_formula = "s·b·vocab x 4 B/tp (logits gradient)"
    temp = sbv * 4 / spec.tp
    if stage == 0 and spec.dp > 1:
        temp += n * g
        temp_formula += f" + params/(tp·pp) x {g} B (DDP's gradient buckets)"
    elif stage == 3 and shard > 1:
        temp += lp * (2 * w + g)
        temp_formula += (f" + layer params/tp x (2 x {w} B gathered, next one prefetched, "
                         f"+ {g} B gradients to reduce-scatter)")
        temp_inputs["layer_params"] = layer_params(spec)
        if spec.reference and spec.params is None:
            # the trainer's root unit (embeddings, positions, final norm, tied head): FSDP2
            # keeps the root gathered from forward to the end of backward
            root = embedding_params(spec) + position_params(spec) + 2 * spec.hidden
            temp += root / spec.tp * (w + g)
            temp_formula += (f" + root unit params x ({w} + {g}) B (the trainer's embeddings, "
                             "positions and final norm: FSDP2 keeps its root gathered)")
            temp_inputs["root_params"] = root
    elif stage in (1, 2) and shard > 1:
        temp += 2 * lp * g
        temp_formula += f" + 2 x layer params/tp x {g} B (reduce buckets)"
        temp_inputs["layer_params"] = layer_params(spec)
    if spec.precision == "amp-bf16":
        temp += 2 * (lp if stage == 3 and shard > 1 else n)
        temp_formula += " + bf16 copies of the weights autocast makes (2 B per parameter)"
    temp = sheet.add("memory", "temporary_bytes", temp, "bytes", temp_formula, **temp_inputs)

    return sheet.add("memory", "total_bytes", weights + grads + optim + act + temp, "bytes",
                     "weights + gradients + optimizer + activations + temporary (all at "
                     "once: an upper bound, as backward frees activations while gradients "
                     "appear)", weights=weights, gradients=grads, optimizer=optim,
                     activations=act, temporary=temp)
