"""The reference trainer: one rank of a DDP or FSDP2 job, read top to bottom.

    torchrun --nproc-per-node 4 -m trainwatch.trainer --run-dir runs/exp1 [--config FILE]
             [--set train.steps=500 ...]

config -> process group and device -> data -> model, optimizer, schedule -> loop
(data, forward, backward, optimizer; validation and journal milestones now and then)
-> final status. Every rank publishes telemetry into the run directory. Without
torchrun's environment it runs as a single process with no process group.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainwatch.contract.env import FAULT_ENV, RUN_DIR_ENV
from trainwatch.contract.states import FAILED, FINISHED, STOPPED
from trainwatch.errors import ConfigError
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rank.checkpoint import Checkpointer, Restored
from trainwatch.rank.memory_snapshots.live import Live
from trainwatch.trainer.config import Config, load_config
from trainwatch.trainer.console import guard_console
from trainwatch.trainer.data import Dataset, ShardedBatches, ensure_default_dataset, load_dataset
from trainwatch.trainer.faults import FaultInjector
from trainwatch.rank.metrics_server import MetricsServer
from trainwatch.trainer.model import GPT
from trainwatch.trainer import parallel, step_shape
from trainwatch.trainer.stores import bind_stores
from trainwatch.rank.skips import agree_skip_steps
from trainwatch.trainer.state import TrainingState
from trainwatch.rank.telemetry import Telemetry


@dataclass
class Ranks:
    """Where this process sits in the job."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    distributed: bool
    restart_count: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainwatch.trainer",
                                     description="One rank of the trainwatch reference trainer.")
    parser.add_argument("--run-dir", default=os.environ.get(RUN_DIR_ENV),
                        help=f"run directory (default: ${RUN_DIR_ENV})")
    parser.add_argument("--config", help="YAML config file")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a config key, e.g. train.steps=50")
    args = parser.parse_args(argv)
    if not args.run_dir:
        parser.error(f"--run-dir is required (or set {RUN_DIR_ENV})")
    return args


# --------------------------------------------------------------------------- setup

def setup_process_group(cfg: Config) -> Ranks:
    """Join torchrun's job (gloo on CPU, NCCL on GPU) and pick this rank's device."""
    distributed = "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto"
                                              and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        device = torch.device("cpu")
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if distributed:
        bind_stores()  # rank 0 serves the workers' store: on $TRAINWATCH_STORE_ADDR only
        dist.init_process_group("nccl" if use_cuda else "gloo",
                                device_id=device if use_cuda else None)
        restart_count = agree_restart_count(restart_count, device)
    return Ranks(rank, local_rank, world_size, device, distributed, restart_count)


def agree_restart_count(mine: int, device: torch.device) -> int:
    """The job's attempt number: the largest of the nodes' restart counts.

    torchrun counts restarts per node: a node whose workers were restarted only because
    another node's failed (a re-rendezvous) keeps its count, so without this the ranks
    of one attempt would disagree on it (status, journal, one-shot faults).
    """
    count = torch.tensor([mine], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def open_data(cfg: Config, run: RunDir, ranks: Ranks) -> Dataset:
    """The configured dataset, or the built-in corpus prepared into RUN_DIR/data.

    Local rank 0 prepares (if needed) and verifies the checksums once per node; the
    other ranks wait for it, then check sizes only (hashing a large corpus once is enough).
    """
    path = Path(cfg.data.path) if cfg.data.path is not None else run.root / "data"
    if ranks.local_rank == 0:
        if cfg.data.path is None:
            ensure_default_dataset(path, size_bytes=cfg.data.corpus_bytes,
                                   seed=cfg.data.corpus_seed, val_fraction=cfg.data.val_fraction)
        data = load_dataset(path)
    if ranks.distributed:
        dist.barrier()
    return data if ranks.local_rank == 0 else load_dataset(path, checksums=False)


def lr_factor(cfg: Config, step: int) -> float:
    """Linear warmup to 1, then cosine decay to ``min_lr_ratio`` at the last step."""
    o, total = cfg.optim, cfg.train.steps
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    if not o.cosine or total <= o.warmup_steps:
        return 1.0
    progress = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps - 1))
    return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_training_state(cfg: Config, data: Dataset, ranks: Ranks) -> TrainingState:
    """Model, AdamW (no weight decay on biases and norms), LR schedule and this rank's loader.
    Under ``parallel.mode: fsdp``/``hsdp`` the model is sharded first, so AdamW holds the
    shards."""
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    model = GPT(cfg.model).to(ranks.device)
    mode = cfg.parallel.mode
    if parallel.is_sharded(mode):
        if not ranks.distributed:
            raise ConfigError(f"{mode} needs a process group: run it under torchrun (trainwatch "
                              "train --nproc-per-node N), or set parallel.mode: ddp",
                              key="parallel.mode")
        parallel.shard(model, ranks.device, ranks.world_size, cfg.parallel)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.optim.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
        fused=ranks.device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg, s))
    shape = step_shape.StepShape(cfg.train.batch_size, cfg.optim.grad_accum, ranks.world_size)
    loader = ShardedBatches(data.train, context=cfg.model.context,
                            batch_size=cfg.train.batch_size, rank=ranks.rank,
                            world_size=ranks.world_size, seed=cfg.data.shuffle_seed)
    # Per-rank streams for anything random after initialisation (dropout).
    seed = cfg.train.seed + 1 + ranks.rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return TrainingState(model, optimizer, scheduler, loader, mode=mode, shape=shape)


def checkpoint_state(state: TrainingState) -> dict:
    """What a checkpoint holds; ``data`` is the job's data position and the step's shape
    (the same on every rank), the rest is the same on every rank (the checkpointer adds
    every rank's RNG states), or under fsdp each rank's shards."""
    return {**parallel.checkpoint_trees(state.model, state.optimizer, state.scheduler,
                                        state.mode),
            "data": data_position(state)}


def data_position(state: TrainingState) -> dict:
    """The job's data position and the step's shape: all a dying gasp needs of this rank's
    own every step (memory_snapshots/rank_parts.py)."""
    return {**state.loader.state_dict(), "grad_accum": state.grad_accum}


class DataPosition:
    """``data_position`` as an object with ``state_dict()``: one object the whole run, so a
    memory snapshot knows it again from step to step (memory_snapshots/live.py)."""

    def __init__(self, state: TrainingState):
        self.state = state

    def state_dict(self) -> dict:
        return data_position(self.state)


def snapshot_live(state: TrainingState) -> Live | None:
    """The objects ``checkpoint_state`` reads, so a memory snapshot every step copies the
    live tensors instead of calling ``state_dict()`` (live.py checks each step that they
    still are what ``state_dict()`` would give); None under fsdp, whose shards take the
    DCP way."""
    if parallel.is_sharded(state.mode):
        return None
    return Live({"model": state.model, "optimizer": state.optimizer,
                 "scheduler": state.scheduler, "data": DataPosition(state)},
                lambda objects: {name: obj.state_dict() for name, obj in objects.items()})


def restore_checkpoint(state: TrainingState, restored: Restored, group: Any = None) -> None:
    """Put a checkpoint back: weights, optimizer, schedule, data position and step (RNG last,
    just before the loop, with ``restored.restore_rng()``). A sharded one is loaded through
    DCP by every rank (``group``: the checkpointer's). At another world size the step keeps
    the checkpoint's global batch (step_shape.py: or exit 2 when the new world size cannot
    split it) and the loader continues from the job's windows consumed."""
    reshape(state, restored)
    if parallel.is_sharded(state.mode):
        parallel.load_sharded(restored, state.model, state.optimizer, state.scheduler, group)
    else:
        state.model.load_state_dict(restored.shared["model"])
        state.optimizer.load_state_dict(restored.shared["optimizer"])
        state.scheduler.load_state_dict(restored.shared["scheduler"])
    state.loader.load_state_dict(restored.data)
    state.step = restored.step


def reshape(state: TrainingState, restored: Restored) -> None:
    """The step shape this run continues ``restored`` with, and a loader of its batch size."""
    assert state.shape is not None, "build_training_state gives the config's shape"
    saved = step_shape.saved_shape(restored.data, state.shape.grad_accum)
    if saved is None:
        return
    shape = step_shape.reshaped(saved, state.shape.world_size, state.shape.batch_size,
                                file=str(restored.path))
    if shape.batch_size != state.loader.batch_size:
        state.loader = state.loader.resized(shape.batch_size)
    state.shape = shape


def step_fields(state: TrainingState) -> dict[str, int]:
    """The step's shape as the start events journal it (per-rank batch, accumulation and
    the global batch: after a resume at another world size, what changed and what did not)."""
    assert state.shape is not None, "build_training_state gives the config's shape"
    return {"batch_size": state.shape.batch_size, "grad_accum": state.shape.grad_accum,
            "global_batch": state.shape.global_batch}


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA; full precision on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model: GPT, data: Dataset, cfg: Config, ranks: Ranks) -> float:
    """Mean validation loss over ``eval_batches`` fixed batches per rank, across all ranks."""
    model.eval()
    batches = ShardedBatches(data.val, context=cfg.model.context,
                             batch_size=cfg.train.batch_size, rank=ranks.rank,
                             world_size=ranks.world_size, seed=0, shuffle=False)
    total = torch.zeros((), device=ranks.device)
    for _ in range(cfg.train.eval_batches):
        x, y = (t.to(ranks.device) for t in next(batches))
        with autocast(ranks.device):
            _, loss = model(x, y)
        total += loss.float()
    if ranks.distributed:
        dist.all_reduce(total)
    model.train()
    return total.item() / (cfg.train.eval_batches * ranks.world_size)


def due(step: int, interval: int, last: int) -> bool:
    """True after every ``interval``-th step and after the last one (interval 0: never)."""
    return interval > 0 and ((step + 1) % interval == 0 or step == last)


# --------------------------------------------------------------------------- the loop

def train(cfg: Config, run: RunDir, ranks: Ranks, tel: Telemetry, ckpt: Checkpointer) -> None:
    faults = FaultInjector.from_env(
        ranks.rank, attempt=ranks.restart_count,
        on_fire=lambda fault, step: tel.event("fault_injected", step=step, fault=fault.kind))
    with tel.phase("init"):
        data = open_data(cfg, run, ranks)
        state = build_training_state(cfg, data, ranks)
        # the newest verified checkpoint (or memory snapshot), or None on a fresh run
        restored = ckpt.resume(parallel.live_trees(state.model, state.mode))
        if restored is not None:
            restore_checkpoint(state, restored, ckpt.group)
        skip = agree_skip_steps(run, ranks.distributed)  # a rollback's control/skip-steps.json
    model = state.model
    ddp = parallel.wrap(model, cfg.parallel.mode, ranks.device, ranks.distributed)
    reduction = check_sdc(cfg, ranks, tel, model, ddp)
    if faults.reduces:  # TRAINWATCH_FAULT=reduce:...
        if reduction is None:
            raise ConfigError("a reduce fault needs the reduction check: telemetry enabled, "
                              "telemetry.reduction_every > 0 and a run under torchrun with "
                              "parallel.mode: ddp", file=FAULT_ENV, key="reduce")
        reduction.tamper = faults.reduce
    tel.flops_per_token = model.flops_per_token()
    tel.set_info(params=model.num_params(), flops_per_token=tel.flops_per_token,
                 config_digest=cfg.digest(),
                 dataset_sha256=data.manifest["splits"]["train"]["sha256"])
    if ranks.is_main:
        start = dict(world_size=ranks.world_size, params=model.num_params(),
                     config_digest=cfg.digest(), start_step=state.step, steps=cfg.train.steps,
                     **step_fields(state))
        if ranks.restart_count > 0:
            tel.event("restarted", restart_count=ranks.restart_count, **start)
        else:
            tel.event("run_started", **start)

    accum, last = state.grad_accum, cfg.train.steps - 1
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    samples_per_step = accum * state.loader.batch_size  # this rank's
    tokens_per_step = samples_per_step * cfg.model.context
    if restored is not None:
        restored.restore_rng()  # last: the random streams continue exactly where they were
    loss = None
    live = snapshot_live(state)
    for step in range(state.step, cfg.train.steps):
        if step in skip:  # rolled back past a bad batch: drop this step's data, train nothing
            with tel.phase("data"):
                dropped = skip.drop(step, state.loader, accum, final=step == last)
            state.step = step + 1
            if dropped is not None and ranks.is_main:
                tel.event("data_skipped", **dropped)
            if ckpt.after_step(step + 1, lambda: checkpoint_state(state), final=step == last,
                               data=lambda: data_position(state), snapshot_live=live):
                return
            continue
        with tel.step(step) as record:
            loss = torch.zeros((), device=ranks.device)
            for micro in range(accum):
                with tel.phase("data"):
                    x, y = (t.to(ranks.device, non_blocking=True) for t in next(state.loader))
                # Gradients are all-reduced only on the last micro-step.
                sync = micro == accum - 1 or not ranks.distributed
                with parallel.no_sync(ddp, sync):
                    with tel.phase("forward"), faults.forward(step), autocast(ranks.device):
                        _, micro_loss = ddp(x, y)
                        micro_loss = faults.loss(step, micro_loss)  # TRAINWATCH_FAULT=nan:...
                    with tel.phase("backward"):
                        (micro_loss / accum).backward()
                loss += micro_loss.detach() / accum
            with tel.phase("optimizer"):
                grad_norm = parallel.global_norm(
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
                lr = state.scheduler.get_last_lr()[0]
                # NaN/Inf on any rank: every rank skips the update (checkpoint.nonfinite).
                if ckpt.check_step(step, loss, grad_norm, data=state.loader.state_dict):
                    state.optimizer.step()
                    state.scheduler.step()
                state.optimizer.zero_grad(set_to_none=True)
            faults.corrupt(step, model)  # TRAINWATCH_FAULT=sdc:...
            state.step = step + 1
            record.record(loss=loss, grad_norm=grad_norm, lr=lr, tokens=tokens_per_step,
                          samples=samples_per_step)

        alone = faults.evaluation(step)  # TRAINWATCH_FAULT=eval:...: this rank alone
        if alone is not None:
            with tel.phase("eval"):
                deadline = time.monotonic() + alone
                while time.monotonic() < deadline:
                    time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        if due(step, cfg.train.eval_interval, last):
            with tel.phase("eval"):
                val_loss = evaluate(model, data, cfg, ranks)
            perplexity = math.exp(min(val_loss, 50.0))
            tel.log(step, "eval", val_loss=val_loss, val_perplexity=perplexity)
            ckpt.note_metrics(val_loss=val_loss)
            if ranks.is_main:
                tel.event("validation", step=step, val_loss=val_loss, val_perplexity=perplexity)
                print(f"step {step}: val_loss {val_loss:.4f} perplexity {perplexity:.2f}",
                      flush=True)
        if ranks.is_main and due(step, cfg.train.milestone_interval, last):
            tel.event("step_milestone", step=step, loss=loss.item(), lr=lr)
            print(f"step {step}: loss {loss.item():.4f} lr {lr:.2e}", flush=True)
        if ckpt.after_step(step + 1, lambda: checkpoint_state(state), final=step == last,
                           data=lambda: data_position(state), snapshot_live=live):
            return  # stopped on request (SIGTERM), after saving a checkpoint

    if ranks.is_main:  # the final loss: one read of the device, once per run
        tel.event("finished", step=state.step - 1, steps_completed=state.step,
                  steps=cfg.train.steps,
                  loss=None if loss is None else loss.item())


def check_sdc(cfg: Config, ranks: Ranks, tel: Telemetry, model: torch.nn.Module,
              ddp: torch.nn.Module) -> Any:
    """Turn on the silent-data-corruption checks (docs/sdc.md) the mode has; returns the
    reduction check (or None). Where the mode has not what the config asks for (no
    replicas under fsdp, no DDP all-reduce under fsdp and hsdp), rank 0 says so, once."""
    par, every = cfg.parallel, cfg.telemetry.replica_every
    note = parallel.sdc_note(par, every, cfg.telemetry.reduction_every)
    if note is not None and ranks.is_main:
        print(f"trainwatch: {note}", flush=True)
    group = parallel.replica_group(par, ranks.rank)
    if every > 0 and group is not None:  # replicas that diverge (of each shard, under hsdp)
        tel.check_replicas(model, every=every, replica_group=group)
    if cfg.telemetry.reduction_every > 0 and ranks.distributed and par.mode == "ddp":
        return tel.check_reduction(ddp, every=cfg.telemetry.reduction_every)  # a wrong all-reduce
    return None


class Terminated(BaseException):
    """SIGTERM (torchrun stopping the workers, or an operator) turned into an exception,
    so the rank still writes its final status and journal event."""

    def __init__(self, signum: int):
        super().__init__(f"terminated by {signal.Signals(signum).name}")
        self.exit_code = 128 + signum


def _raise_terminated(signum: int, _frame: object) -> None:
    raise Terminated(signum)


def main(argv: list[str] | None = None) -> int:
    console = guard_console()  # its output files sit on the run directory's disk
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"trainwatch: error: {exc}", file=sys.stderr)
        return exc.exit_code
    signal.signal(signal.SIGTERM, _raise_terminated)
    run = RunDir(args.run_dir)
    ranks = setup_process_group(cfg)
    tel = Telemetry.from_env(run.root, heartbeat_interval=cfg.telemetry.heartbeat_interval,
                             exchange_every=cfg.telemetry.exchange_every,
                             peak_flops=cfg.telemetry.peak_flops, device=ranks.device,
                             enabled=cfg.telemetry.enabled, restart_count=ranks.restart_count)
    console.on_failing = tel.count_error  # a dropped line is a failed trainwatch write
    # From here on SIGTERM means "checkpoint, then stop" (see docs/checkpoints.md).
    ckpt = Checkpointer(cfg.checkpoint, run.root, telemetry=tel,
                        config_hash=cfg.training_digest(),
                        sharded=parallel.is_sharded(cfg.parallel.mode))
    server = None
    try:
        run.create()
        tel.start()
        if cfg.telemetry.metrics_port and tel.enabled:
            server = MetricsServer(tel, cfg.telemetry.metrics_port + ranks.local_rank,
                                   cfg.telemetry.metrics_host)
        ckpt.start()
        train(cfg, run, ranks, tel, ckpt)
        # SIGTERM stays handled until the final status is written (Checkpoints._stop says why)
        ckpt.close(signals=False)
    except BaseException as exc:
        ckpt.close()
        tel.event("failed", error=f"{type(exc).__name__}: {exc}")
        tel.close(FAILED)
        if isinstance(exc, (ConfigError, Terminated)):
            print(f"trainwatch: rank {ranks.rank}: {exc}", file=sys.stderr)
            return exc.exit_code
        raise
    finally:
        if server is not None:
            server.close()
    tel.close(STOPPED if ckpt.exit_code else FINISHED)
    if ranks.distributed:
        gc.collect()  # DDP sits in a reference cycle: free it and its hold on the group first
        dist.destroy_process_group()
    ckpt.requests.uninstall()
    return ckpt.exit_code
