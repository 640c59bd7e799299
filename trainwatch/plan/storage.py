"""Storage: the dataset, checkpoints (size x copies kept, + the mirror), logs and metrics.

A checkpoint holds the weights and the optimizer state (the fp32 master copy and the
moments); gradients and activations are never saved. For the reference trainer the
size is exact to well under 1 %: its files are ``torch.save`` zip archives, which add
a small record per tensor (the constants below, measured with torch 2.13 and checked
against a real run by tests/plan/test_plan_measured.py).
"""

from __future__ import annotations

from trainwatch.plan.memory import MOMENTS, PRECISION_BYTES
from trainwatch.plan.model import embedding_params
from trainwatch.plan.sheet import Sheet
from trainwatch.plan.spec import PlanSpec, trainer_mode

# torch.save's zip container, per file of the reference trainer's checkpoints
MODEL_RECORD_BYTES, MODEL_FILE_BYTES = 292, 330          # per tensor, per file
OPTIMIZER_PARAM_BYTES, OPTIMIZER_FILE_BYTES = 793, 705   # per parameter (step + 2 moments)
SCHEDULER_FILE_BYTES = 1453                               # LambdaLR state
RANK_FILE_BYTES = 14_313                                  # RNG states + data position
MANIFEST_BYTES, MANIFEST_RANK_BYTES = 800, 210
# a DCP checkpoint of the trainer's sharded modes (parallel.mode fsdp/hsdp; torch 2.13)
# (least squares over 1-3 ranks and 1-3 layers: each within 0.6 % of the real size)
DCP_CHUNK_BYTES = 1579         # torch.save record of each tensor chunk in a .distcp file
DCP_OBJECTS_BYTES = 41_136     # the pickled plain state: schedule, optimizer param groups
DCP_METADATA_KEY_BYTES, DCP_METADATA_CHUNK_BYTES, DCP_METADATA_BYTES = 97, 193, 5_231
DCP_MANIFEST_KEY_BYTES, DCP_MANIFEST_RANK_BYTES, DCP_MANIFEST_BYTES = 71, 360, 466
DCP_RANK_FILE_BYTES = 14_398   # RNG states + data position (+ the rank)
METRICS_BYTES_PER_STEP = 512   # one metrics line per rank per step (about 450 B measured)
JOURNAL_BYTES = 1 << 20        # journal, status files, launcher and agent logs: a few MB


def dcp_checkpoint_bytes(spec: PlanSpec, params: int, sheet: Sheet) -> float:
    """The reference trainer's checkpoint under parallel.mode fsdp/hsdp: DCP files. Every
    state-dict tensor (the tied head as a key of its own) and each parameter's two AdamW
    moments are sharded, one chunk per rank of a shard group (a replicated shard is written
    once); each parameter's step is one plain tensor; schedule and param groups are
    pickled by rank 0; ``.metadata`` indexes every key and chunk; the manifest lists each
    DTensor's placements."""
    moments = MOMENTS[spec.optimizer]
    params_n = 12 * spec.layers + 4            # parameters (the tied head once)
    keys = params_n + 1                        # model state-dict tensors
    sharded_keys = keys + moments * params_n   # DTensors: weights and moments
    chunks = sharded_keys * spec.shard_group + params_n
    saved = params + embedding_params(spec)    # the tied head written again
    return sheet.add(
        "storage", "checkpoint_bytes",
        4 * saved + 4 * moments * params + 4 * params_n + DCP_CHUNK_BYTES * chunks
        + DCP_OBJECTS_BYTES + DCP_METADATA_KEY_BYTES * (keys + moments * params_n + params_n)
        + DCP_METADATA_CHUNK_BYTES * chunks + DCP_METADATA_BYTES
        + DCP_MANIFEST_KEY_BYTES * sharded_keys + DCP_MANIFEST_BYTES
        + spec.devices * (DCP_RANK_FILE_BYTES + DCP_MANIFEST_RANK_BYTES), "bytes",
        f"DCP: 4 B x (params + vocab·h: the tied head again) + 4 B x moments x params "
        f"+ 4 B x parameters (steps) + chunks x ({DCP_CHUNK_BYTES} B record + "
        f"{DCP_METADATA_CHUNK_BYTES} B .metadata) + {DCP_OBJECTS_BYTES} B pickled schedule "
        f"and param groups + {DCP_MANIFEST_KEY_BYTES} B x sharded keys (manifest "
        f"placements) + ranks x {DCP_RANK_FILE_BYTES + DCP_MANIFEST_RANK_BYTES} B "
        f"(rank file, manifest entry) + {DCP_METADATA_BYTES + DCP_MANIFEST_BYTES} B; "
        "chunks = sharded keys x shard degree + parameters",
        params=params, parameters=params_n, sharded_keys=sharded_keys, chunks=chunks,
        shard_degree=spec.shard_group, ranks=spec.devices, vocab_h=embedding_params(spec))


def checkpoint_bytes(spec: PlanSpec, params: int, sheet: Sheet) -> float:
    w, _g, master, moment = PRECISION_BYTES[spec.precision]
    moments = MOMENTS[spec.optimizer]
    if trainer_mode(spec) in ("fsdp", "hsdp"):
        return dcp_checkpoint_bytes(spec, params, sheet)
    if spec.reference and spec.params is None:
        # state_dict entries (the tied head included); an async save's host copy holds the
        # tied head as a tensor of its own, so it is written twice (a sync save writes it once)
        tensors = 12 * spec.layers + 5
        twice = spec.checkpoint_async and spec.tied_embeddings
        saved = params + (embedding_params(spec) if twice else 0)
        records = tensors if twice else tensors - 1
        world = spec.devices
        return sheet.add(
            "storage", "checkpoint_bytes",
            4 * saved + MODEL_RECORD_BYTES * records + MODEL_FILE_BYTES
            + 4 * moments * params + OPTIMIZER_PARAM_BYTES * (tensors - 1) + OPTIMIZER_FILE_BYTES
            + SCHEDULER_FILE_BYTES + world * (RANK_FILE_BYTES + MANIFEST_RANK_BYTES)
            + MANIFEST_BYTES, "bytes",
            "model.pt: 4 B x (params + vocab·h if async: the tied head again) + 292 B x tensors "
            "+ 330; "
            "optimizer.pt: 4 B x moments x params + 793 B x parameters + 705; "
            "scheduler.pt 1453; ranks x (14313 B rank file + 210 B manifest entry); "
            "manifest 800", params=params, tensors=tensors, vocab_h=embedding_params(spec),
            moments=moments, ranks=world, async_save=spec.checkpoint_async)
    per_param = w + master + moments * moment
    return sheet.add("storage", "checkpoint_bytes", params * per_param, "bytes",
                     f"params x ({w} B weights + {master} B master + {moments} moments x "
                     f"{moment} B)", params=params, precision=spec.precision,
                     optimizer=spec.optimizer)


def storage(spec: PlanSpec, params: int, sheet: Sheet) -> None:
    ckpt = checkpoint_bytes(spec, params, sheet)
    data = sheet.add("storage", "data_bytes",
                     spec.data_bytes if spec.data_bytes is not None
                     else spec.total_tokens * spec.bytes_per_token, "bytes",
                     "given (dataset size)" if spec.data_bytes is not None
                     else "tokens x bytes_per_token", tokens=spec.total_tokens,
                     bytes_per_token=spec.bytes_per_token)
    copies = spec.checkpoints_kept + 1 if spec.checkpoints_kept else 0
    primary = sheet.add("storage", "checkpoints_bytes", ckpt * copies, "bytes",
                        "checkpoint_bytes x (kept + 1: the next save is written before the "
                        "oldest is pruned)", checkpoint_bytes=ckpt, kept=spec.checkpoints_kept)
    mirror = sheet.add("storage", "mirror_bytes", primary if spec.mirror else 0, "bytes",
                       "the same again on the mirror's disk" if spec.mirror else "no mirror",
                       mirror=spec.mirror)
    ranks = spec.devices
    logs = sheet.add("storage", "logs_bytes",
                     spec.total_steps * ranks * METRICS_BYTES_PER_STEP + JOURNAL_BYTES, "bytes",
                     f"steps x ranks x {METRICS_BYTES_PER_STEP} B (metrics lines) + 1 MiB "
                     "(journal, status, logs)", steps=spec.total_steps, ranks=ranks)
    sheet.add("storage", "free_bytes_needed", data + primary + mirror + logs, "bytes",
              "data + checkpoints + mirror + logs (the mirror on its own disk)",
              data=data, checkpoints=primary, mirror=mirror, logs=logs)
    sheet.add("storage", "write_bytes_per_second", spec.write_bytes_per_second, "bytes/s",
              "assumed checkpoint write throughput (--write-gbps; trainwatch rehearse "
              "measures it)")
