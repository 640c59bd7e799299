"""Expected interruptions at a run's scale and the checkpoint interval that minimises waste.

Failure rate per device: Meta's Llama 3 report ("The Llama 3 Herd of Models", 2024,
section 3.3.4) counts 419 unexpected interruptions in a 54-day snapshot of pre-training
on up to 16,384 H100 GPUs, 78 % of them hardware. Spread over every GPU for the whole
snapshot that is one interruption per 16384 x 54 x 24 / 419 = 50,676 GPU-hours; the
job's mean time between failures shrinks as 1/devices. Replace it with your fleet's own
figure (--device-mtbf-hours): ``trainwatch report`` measures a run's.
"""

from __future__ import annotations

from trainwatch.plan import interval
from trainwatch.plan.sheet import Sheet
from trainwatch.plan.spec import PlanSpec

LLAMA3_INTERRUPTIONS, LLAMA3_GPUS, LLAMA3_DAYS = 419, 16384, 54
DEVICE_MTBF_HOURS = LLAMA3_GPUS * LLAMA3_DAYS * 24 / LLAMA3_INTERRUPTIONS


def reliability(spec: PlanSpec, hours: float | None, step_seconds: float | None,
                checkpoint_bytes: float, sheet: Sheet) -> None:
    device_mtbf = spec.device_mtbf_hours or DEVICE_MTBF_HOURS
    mtbf = sheet.add("reliability", "job_mtbf_hours", device_mtbf / spec.devices, "h",
                     "device_mtbf_hours / devices" + (
                         "" if spec.device_mtbf_hours else
                         " (device MTBF from Llama 3: 16384 GPUs x 54 days x 24 h / 419 "
                         "unexpected interruptions)"),
                     device_mtbf_hours=device_mtbf, devices=spec.devices)
    save = sheet.add("reliability", "save_seconds",
                     spec.save_seconds if spec.save_seconds is not None
                     else checkpoint_bytes / spec.write_bytes_per_second, "s",
                     "given (--save-seconds, measured)" if spec.save_seconds is not None
                     else "checkpoint_bytes / write_bytes_per_second",
                     checkpoint_bytes=checkpoint_bytes,
                     write_bytes_per_second=spec.write_bytes_per_second)
    every = sheet.add("reliability", "checkpoint_interval_seconds",
                      interval.young_daly_interval(save, mtbf * 3600), "s",
                      f"Young/Daly: {interval.FORMULA}", save_seconds=save,
                      mtbf_seconds=mtbf * 3600)
    run_steps = round(hours * 3600 / step_seconds) if hours and step_seconds else None
    every_steps = None if not step_seconds else max(1, round(every / step_seconds))
    if every_steps is not None and run_steps and every_steps > run_steps:
        # An interval past the run's end means: the run is too short to need one.
        sheet.add("reliability", "checkpoint_every_steps", max(1, run_steps), "steps",
                  "the run's own steps: checkpoint_interval_seconds / step_seconds is "
                  "longer than the whole run (a checkpoint at its end is enough)",
                  interval_steps=every_steps, run_steps=run_steps)
    else:
        sheet.add("reliability", "checkpoint_every_steps", every_steps, "steps",
                  "checkpoint_interval_seconds / step_seconds", step_seconds=step_seconds)
    if hours is None:
        sheet.add("reliability", "expected_interruptions", None, "",
                  "unknown: the run's duration is unknown (give --peak-flops)")
        sheet.add("reliability", "expected_lost_hours", None, "h", "unknown")
        return
    count = sheet.add("reliability", "expected_interruptions", hours / mtbf, "",
                      "hours / job_mtbf_hours", hours=hours)
    saving = hours * save / every if every else 0.0
    sheet.add("reliability", "expected_lost_hours",
              count * (every / 2 + spec.restart_seconds) / 3600 + saving, "h",
              "interruptions x (interval / 2 recomputed + restart_seconds) + hours x "
              "save_seconds / interval (time spent saving)", interruptions=count,
              restart_seconds=spec.restart_seconds)
