"""Parameter counts of a GPT-style decoder, the reference trainer's and a described one.

Per layer: attention q, k, v and output (4·h² + 4·h), MLP up and down (2·h·F + F + h),
two LayerNorms (4·h); then token embeddings (V·h, the head tied to them unless
untied), learned positions (S·h) and a final LayerNorm (2·h). The reference trainer's
``GPT.num_params()`` is this total less the position table (a lookup costs no FLOPs).
"""

from __future__ import annotations

from trainwatch.plan.sheet import Sheet
from trainwatch.plan.spec import PlanSpec


def layer_params(spec: PlanSpec) -> int:
    h, f = spec.hidden, spec.ffn_width
    return 4 * h * h + 2 * h * f + 9 * h + f


def embedding_params(spec: PlanSpec) -> int:
    return spec.vocab * spec.hidden * (1 if spec.tied_embeddings else 2)


def position_params(spec: PlanSpec) -> int:
    return spec.seq * spec.hidden if spec.learned_positions else 0


def model_params(spec: PlanSpec, sheet: Sheet) -> tuple[int, int]:
    """(all parameters, parameters that cost FLOPs per token), added to the sheet."""
    if spec.params is not None:
        total = sheet.add("model", "params", spec.params, "parameters", "given (--params)")
        lookup = 0
    else:
        total = sheet.add(
            "model", "params",
            spec.layers * layer_params(spec) + embedding_params(spec) + position_params(spec)
            + 2 * spec.hidden, "parameters",
            "layers x (4·h² + 2·h·F + 9·h + F) + vocab·h x (1 tied | 2 untied) + seq·h "
            "(learned positions) + 2·h (final norm)",
            layers=spec.layers, h=spec.hidden, F=spec.ffn_width, vocab=spec.vocab,
            seq=spec.seq, tied=spec.tied_embeddings, learned_positions=spec.learned_positions)
        lookup = position_params(spec) + (0 if spec.tied_embeddings
                                          else spec.vocab * spec.hidden)
    flop_params = sheet.add("model", "flop_params", total - lookup, "parameters",
                            "params - lookup-only tables (positions, untied input embedding)",
                            params=total, lookup=lookup)
    return total, flop_params
