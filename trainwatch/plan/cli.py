"""``trainwatch plan``: memory per device, compute, cost, storage and interruptions of a run."""

from __future__ import annotations

import json
from typing import Any

import click

from trainwatch.plan.devices import DEVICE_TYPES
from trainwatch.plan.spec import (DESCRIBED_SEQ, DESCRIBED_VOCAB, OPTIMIZERS, PRECISIONS,
                                  RECOMPUTE, SHARDING,
                                  PlanSpec, from_trainer_config, layers_for, parse_count)

MODEL_OPTIONS = ("params", "layers", "hidden")


def build_spec(config: str | None, overrides: tuple[str, ...], options: dict[str, Any]
               ) -> PlanSpec:
    """The reference trainer's config (file, --set, or its defaults) unless the options
    describe a model; then every given option overrides."""
    given = {k: v for k, v in options.items() if v is not None}
    device = given.get("device_type", "h100")
    if config is None and not overrides and any(k in given for k in MODEL_OPTIONS):
        spec = PlanSpec(source="described by options", reference=False, vocab=DESCRIBED_VOCAB,
                        seq=DESCRIBED_SEQ, micro_batch=1, steps=None, data_bytes=None,
                        precision="bf16-mixed" if device != "cpu" else "fp32")
        if "params" in given and not {"layers", "hidden"} & set(given):
            spec.layers, spec.hidden = layers_for(given["params"])
            spec.heads = spec.hidden // 128
        elif "hidden" in given and "heads" not in given:
            spec.heads = max(1, given["hidden"] // 128)
    else:
        from trainwatch.trainer.config import load_config  # reads and validates the YAML
        cfg = load_config(config, overrides)
        if "device_type" not in given and cfg.train.device == "cpu":
            device = "cpu"
        spec = from_trainer_config(cfg, config or ("--set" if overrides else
                                                   "reference trainer defaults"),
                                   devices=given.get("devices", 1), device_type=device)
    if "params" in given:
        given["params"] = int(given["params"])
    for key, value in given.items():
        setattr(spec, key, value)
    spec.device_type = device
    return spec.validate()


def _count(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    return None if value is None else parse_count(value, f"--{param.name.replace('_', '-')}")


def _gbps(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    return None if value is None else value * 1e9


@click.command("plan")
@click.option("--config", type=click.Path(dir_okay=False),
              help="The reference trainer's YAML config (default: its built-in defaults).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override one trainer config key (repeatable).")
@click.option("--params", callback=_count, metavar="N",
              help="Parameter count (7e9, 7B, 125M): describe a model instead of the config.")
@click.option("--layers", type=int, help="Transformer layers.")
@click.option("--hidden", type=int, help="Hidden width.")
@click.option("--heads", type=int, help="Attention heads (default hidden / 128).")
@click.option("--seq", type=int,
              help=f"Sequence length in tokens (described models: {DESCRIBED_SEQ}).")
@click.option("--vocab", type=int, help=f"Vocabulary size (described models: {DESCRIBED_VOCAB}).")
@click.option("--ffn", type=int, help="MLP width (default 4 x hidden).")
@click.option("--micro-batch", type=int,
              help="Sequences per device per micro-batch (described models: 1).")
@click.option("--grad-accum", type=int, help="Micro-batches per optimizer step.")
@click.option("--precision", type=click.Choice(PRECISIONS),
              help="fp32; amp-bf16 (fp32 weights, bf16 autocast: the reference trainer on "
                   "GPU); bf16-mixed (bf16 weights and gradients, fp32 master copy); bf16.")
@click.option("--optimizer", type=click.Choice(OPTIMIZERS),
              help="Optimizer whose state is kept (described models: adamw).")
@click.option("--devices", type=int, help="Devices in the job (default 1).")
@click.option("--tp", type=int, help="Tensor-parallel degree.")
@click.option("--pp", type=int, help="Pipeline-parallel degree.")
@click.option("--sharding", type=click.Choice(SHARDING),
              help="Shard over the data-parallel group: ZeRO-1 optimizer, ZeRO-2 "
                   "+gradients, full = ZeRO-3 / FSDP FULL_SHARD.")
@click.option("--shard-degree", type=int,
              help="Devices a shard spans (hybrid sharding); default the data-parallel degree.")
@click.option("--recompute", type=click.Choice(RECOMPUTE), help="Activation recomputation.")
@click.option("--dropout/--no-dropout", default=None,
              help="Dropout layers (their masks are kept for backward).")
@click.option("--no-flash-attention", "flash_attention", flag_value=False, default=None,
              help="Attention stores its s x s matrix (eager attention).")
@click.option("--tokens", callback=_count, metavar="N", help="Tokens to train on (2T, 1e12).")
@click.option("--steps", type=int, help="Optimizer steps (when --tokens is not given).")
@click.option("--device-type", type=click.Choice(sorted(DEVICE_TYPES), case_sensitive=False),
              help="Device for time and cost (default h100; the memory verdict covers all).")
@click.option("--mfu", type=float, help="Assumed model FLOPs utilisation (default 0.4).")
@click.option("--peak-flops", callback=_count, metavar="FLOP/S",
              help="Peak FLOP/s per device, overriding the table (needed for cpu).")
@click.option("--price", "price_per_device_hour", type=float,
              help="Price per device-hour, for the cost.")
@click.option("--data-bytes", callback=_count, metavar="BYTES",
              help="Dataset size (default tokens x --bytes-per-token).")
@click.option("--bytes-per-token", type=float, help="Dataset bytes per token (default 2).")
@click.option("--keep", "checkpoints_kept", type=int, help="Checkpoints kept (default 3).")
@click.option("--mirror/--no-mirror", default=None, help="A second copy of every checkpoint.")
@click.option("--save-seconds", type=float,
              help="Measured seconds per checkpoint save (default: size / write throughput).")
@click.option("--write-gbps", "write_bytes_per_second", type=float, callback=_gbps,
              help="Assumed checkpoint write throughput in GB/s (default 1).")
@click.option("--device-mtbf-hours", type=float,
              help="Device-hours between failures (default: Llama 3's, docs/plan.md).")
@click.option("--restart-seconds", type=float,
              help="Seconds from a failure to training again (default 600).")
@click.option("--explain", is_flag=True, help="Show each number's formula and inputs.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def plan(config, overrides, explain, as_json, **options) -> None:
    """Size a run: memory per device (and whether it fits, with 20 % headroom), compute,
    time and cost, storage, expected interruptions and the checkpoint interval.

    With no model options it plans the reference trainer's config (defaults, --config,
    --set); --params N or --layers/--hidden describe another model.
    """
    from trainwatch.plan.estimate import make_plan
    from trainwatch.plan.render import render

    spec = build_spec(config, overrides, options)
    result = make_plan(spec)
    # What the header's "1 x h100" rests on when the user said nothing about devices.
    result["assumed"] = [f"--{k.replace('_', '-')}" for k in ("devices", "device_type")
                         if options.get(k) is None and not (k == "device_type"
                                                            and spec.device_type == "cpu")]
    if as_json:
        if not explain:
            result.pop("explain")
        click.echo(json.dumps(result, indent=1, default=str))
    else:
        click.echo(render(result, explain=explain))
