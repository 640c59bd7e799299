"""The plan as text: one table per section, the device verdicts, and with --explain the
formula and inputs under each number."""

from __future__ import annotations

from typing import Any

SECTIONS = ("model", "memory", "compute", "storage", "reliability")


def human(value: Any, unit: str) -> str:
    if value is None:
        return "unknown"
    if unit == "bytes":
        for size, name in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if abs(value) >= size:
                return f"{value / size:,.2f} {name}"
        return f"{value:,.0f} B"
    if unit == "bytes/s":
        return f"{value / 1e9:,.2f} GB/s"
    if unit in ("FLOP",):
        return f"{value:.3e} FLOP"
    if unit == "price":  # the --price's own currency, whatever it is
        return f"{value:,.2f} (in the currency of --price)"
    if unit == "s" and value >= 120:
        return f"{value:,.0f} s ({value / 3600:,.2f} h)"
    if isinstance(value, float):
        return f"{value:,.4g} {unit}".rstrip()
    return f"{value:,} {unit}".rstrip() if isinstance(value, int) else f"{value} {unit}"


def render(plan: dict[str, Any], explain: bool = False) -> str:
    spec, notes = plan["spec"], plan["explain"]
    assumed = plan.get("assumed") or []
    lines = [f"trainwatch plan · {spec['source']} · {spec['devices']} x {spec['device_type']}"
             + (f" (assumed: give {' and '.join(assumed)})" if assumed else "")
             + f" · {spec['precision']} {spec['optimizer']} · tp {spec['tp']} pp {spec['pp']} "
             f"sharding {spec['sharding']}{_mode(plan)} · recompute {spec['recompute']}"]
    for section in SECTIONS:
        lines.append("")
        lines.append(section + (" (per device)" if section == "memory" else ""))
        for key, value in plan[section].items():
            note = notes[f"{section}.{key}"]
            lines.append(f"  {key:<38} {human(value, note['unit'])}")
            if explain:
                lines.append(f"      = {note['formula']}")
                if note["inputs"]:
                    shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in note["inputs"].items())
                    lines.append(f"        with {shown}")
    lines.append("")
    lines.append(f"fits? (keep {plan['headroom']:.0%} of device memory free)")
    for d in plan["devices"]:
        lines.append(f"  {d['name']:<26} {human(d['memory_bytes'], 'bytes'):>10}  "
                     f"{d['verdict']:<13} with full recompute: {d['verdict_with_recompute']}")
    return "\n".join(lines)


def _mode(plan: dict[str, Any]) -> str:
    """What the reference trainer runs this layout as (``parallel.mode``), or that it cannot."""
    if not plan["spec"]["reference"] or plan["spec"]["params"] is not None:
        return ""
    mode = plan.get("trainer_mode")
    return (f" (trainer parallel.mode: {mode})" if mode
            else " (not a layout the reference trainer runs: its modes are ddp, fsdp, hsdp)")
