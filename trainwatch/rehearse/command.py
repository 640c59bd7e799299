"""Rehearsing a user's own training command: what its run directory can show.

The command runs with ``TRAINWATCH_RUN_DIR`` (and ``TRAINWATCH_REHEARSAL=1``, a hint to
train only a few steps); a loop instrumented with trainwatch's telemetry writes its step
records there, and one using trainwatch's Checkpointer its checkpoints. From those:
the command's exit, finite losses and gradient norms, the loss trend, telemetry reaching
the agent, and a round trip of its newest checkpoint. What only the reference trainer's
rehearsal can do (over-fitting one batch, plan's estimates for the model, the config
digest on every rank) is listed under ``remains``.
"""

from __future__ import annotations

import math
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from trainwatch.rehearse.checks import Check
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.jsonl import read_jsonl

LOSS_DROP = 0.01


def step_records(run: RunDir) -> dict[int, list[dict[str, Any]]]:
    return {r: [rec for rec in read_jsonl(run.metrics_file(r)).records
                if rec.get("kind") == "step"] for r in run.ranks_with_metrics()}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


def loss_checks(records: dict[int, list[dict[str, Any]]]) -> list[Check]:
    if not any(records.values()):
        return [Check("steps", "FAIL", "the command wrote no step records to the run directory "
                      "(is its loop instrumented with trainwatch telemetry, "
                      "Telemetry.from_env()?)"),
                Check("loss_falls", "SKIP", "no losses recorded")]
    bad = [f"rank {r} step {rec.get('step')}" for r, recs in sorted(records.items())
           for rec in recs for key in ("loss", "grad_norm")
           if rec.get(key) is not None and not math.isfinite(_number(rec.get(key)) or math.nan)]
    checks = [Check("steps", "FAIL", "non-finite loss or gradient norm at " + ", ".join(bad[:5]))
              if bad else Check("steps", "PASS", f"{len(records)} rank(s) recorded "
                                f"{max(len(v) for v in records.values())} steps, all finite")]
    losses = [x for rec in records[min(records)] if (x := _number(rec.get("loss"))) is not None]
    if len(losses) < 6:
        checks.append(Check("loss_falls", "SKIP", f"{len(losses)} losses recorded: too few"))
        return checks
    third = max(2, len(losses) // 3)
    head, tail = losses[:third], losses[-third:]
    first, last = statistics.fmean(head), statistics.fmean(tail)
    # Batches differ from step to step: the fall must stand out of their noise too.
    noise = 2 * math.sqrt((statistics.variance(head) + statistics.variance(tail)) / third) \
        if all(map(math.isfinite, head + tail)) else math.nan
    evidence = {"losses": losses, "noise": noise}
    if not (math.isfinite(first) and math.isfinite(last)) or \
            last > first * (1 - LOSS_DROP) or first - last <= noise:
        checks.append(Check("loss_falls", "FAIL", f"the loss did not fall: mean of the first "
                            f"third {first:.4g}, of the last {last:.4g} ({len(losses)} steps; "
                            f"a fall must exceed 1 % and twice its standard error, "
                            f"{noise:.3g})", evidence))
    else:
        checks.append(Check("loss_falls", "PASS", f"mean loss {first:.4g} -> {last:.4g} over "
                            f"{len(losses)} steps", evidence))
    return checks


def checkpoint_round_trip(run: RunDir) -> Check:
    """The newest verified checkpoint's files: load, save, load again; same digests."""
    from trainwatch.checkpoint_format.catalog import complete
    from trainwatch.checkpoint_format.manifest import verify
    from trainwatch.checkpoint_format.dcp import METADATA as DCP_METADATA
    from trainwatch.rehearse.worker import dcp_state, tree_digest
    import torch

    found = complete(run.checkpoint_dir) if run.checkpoint_dir.is_dir() else []
    if not found:
        return Check("checkpoint_round_trip", "SKIP", "the command saved no checkpoint in "
                     f"{run.checkpoint_dir} (trainwatch's Checkpointer writes them there)")
    path = found[0].path  # newest first
    checked = verify(path)
    if not checked.ok:
        return Check("checkpoint_round_trip", "FAIL", f"{path.name} does not verify: "
                     f"{checked.reason}")
    sharded = (Path(path) / DCP_METADATA).exists()  # a DCP checkpoint: its shards whole
    with tempfile.TemporaryDirectory() as tmp:
        for f in sorted(Path(path).glob("*.pt")) + ([Path(path)] if sharded else []):
            state = (dcp_state(f) if f.is_dir()
                     else torch.load(f, map_location="cpu", weights_only=True))
            torch.save(state, Path(tmp) / "again.pt")
            again = torch.load(Path(tmp) / "again.pt", map_location="cpu", weights_only=True)
            if tree_digest(state) != tree_digest(again):
                return Check("checkpoint_round_trip", "FAIL", f"{f.name}: load -> save -> load "
                             "changed it")
    return Check("checkpoint_round_trip", "PASS", f"{path.name} verifies; its files load"
                 + (" (its DCP shards as one state)" if sharded else "")
                 + ", save and load again to the same digests")


def command_checks(run: RunDir, code: int | None, tail: str, started: float,
                   agent_url: str | None, agent_proc: subprocess.Popen | None
                   ) -> tuple[list[Check], list[str]]:
    from trainwatch.rehearse.runner import telemetry_check

    checks = []
    if code is None:
        checks.append(Check("job", "FAIL", "the command did not end in time", {"log_tail": tail}))
    elif code != 0 and run.finished_since(started):
        checks.append(Check("job", "WARN", f"the command exited {code} after every rank "
                            "reported finished: a crash on the way out, which torchrun "
                            "--max-restarts would restart (docs/own-trainer.md, Exit cleanly)",
                            {"log_tail": tail}))
    elif code != 0:
        checks.append(Check("job", "FAIL", f"the command exited {code}", {"log_tail": tail}))
    else:
        checks.append(Check("job", "PASS", "the command exited 0"))
    records = step_records(run)
    checks += loss_checks(records)
    if records:
        steps = min(len(v) for v in records.values())
        checks.append(telemetry_check(agent_url, agent_proc, len(records), steps))
    else:
        checks.append(Check("telemetry", "SKIP", "the command published no telemetry"))
    checks.append(checkpoint_round_trip(run))
    remains = [
        "versions and config digest of the command's own ranks: its status files do not "
        "carry them (the versions check ran trainwatch's probe ranks on this interpreter)",
        "over-fitting one batch: only the reference trainer's rehearsal can hold the batch "
        "fixed; here the loss trend of the command's own steps is checked",
        "plan's memory and checkpoint estimates: describe the model to `trainwatch plan` "
        "(--params or --layers/--hidden/--seq) and compare with the status files' "
        "memory_bytes and the checkpoint sizes",
    ]
    return checks, remains
