"""PyTorch Lightning: telemetry, verified checkpoints and checkpoint-now requests by callback.

    from trainwatch.integrations.lightning import TrainwatchCallback
    cb = TrainwatchCallback(every_steps=100)
    trainer = L.Trainer(callbacks=[cb], ...)
    trainer.fit(model, data, ckpt_path=cb.resume_path())   # newest verified; None when none

Per rank: a step per optimizer step (``global_step``; with ``accumulate_grad_batches`` its
micro-batches) with forward (batch start to backward), backward and optimizer phases from
Lightning's hooks, and the loss ``training_step`` returned (the tensor itself: no device
sync; a logged ``grad_norm`` too, if the module logs one).
Checkpoints are Lightning's own (``trainer.save_checkpoint``), written into
``RUN_DIR/checkpoints/step-N/`` and sealed with a trainwatch manifest, every
``every_steps`` (default: the checkpoint library's, 100; 0 warns: then only on request and
on SIGTERM), when ``RUN_DIR/control/checkpoint`` is touched (CheckpointTooOld's
action) and on SIGTERM (the callback's own handler during fit, see ``StopSignal``: the
ranks agree on the step with one small all-reduce per batch, save, and exit 75).
``resume_path()`` is the newest of them that verifies. A strategy that saves sharded
(ModelParallelStrategy's FSDP2, ``FSDPStrategy(state_dict_type="sharded")``: every rank
writes its DCP shard) fills ``step-N/`` itself, sealed with every shard (docs/own-trainer.md,
"Sharded models with Lightning / Hugging Face"). ``replica_every=N`` digests the
module's parameters every N steps for the replica check (docs/sdc.md). Needs ``lightning``
installed.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from trainwatch.contract.env import run_dir_from_env
from trainwatch.contract.states import BAD_INPUT, FAILED, FINISHED, STOPPED
from trainwatch.errors import ConfigError
from trainwatch.integrations.batches import batch_size
from trainwatch.integrations.lightning_snapshots import LightningSnapshots
from trainwatch.integrations.options import SNAPSHOT_OPTIONS, snapshot_options, telemetry_options
from trainwatch.integrations.sealed import newest_verified, seal
from trainwatch.integrations.sharded_folder import checkpoint_in, flatten
from trainwatch.integrations.stopsignal import StopSignal
from trainwatch.rundir.run_dir import RunDir
from trainwatch.checkpoint_format import catalog
from trainwatch.rank.checkpoint import retention
from trainwatch.rank.checkpoint.cadence import interval_due
from trainwatch.rank.checkpoint.checkpointer import EXIT_STOPPED
from trainwatch.rank.checkpoint.config import CheckpointConfig
from trainwatch.checkpoint_format.manifest import step_dir_name
from trainwatch.rank.telemetry import Telemetry

CHECKPOINT_FILE = "lightning.ckpt"
log = logging.getLogger(__name__)


class TrainwatchCallback(Callback):
    """Telemetry and verified, requestable checkpoints for a Lightning ``Trainer``."""

    def __init__(self, run_dir: str | Path | None = None, *, every_steps: int | None = None,
                 keep_last: int = 3, replica_every: int = 0, memory_snapshots: str = "auto",
                 memory_snapshots_dir: str | None = None, peer_copies: str = "ring",
                 **telemetry: Any):
        self.run = RunDir(run_dir or run_dir_from_env())
        self.snapshots = LightningSnapshots(self.run, snapshot_options(
            {"memory_snapshots": memory_snapshots, "memory_snapshots_dir": memory_snapshots_dir,
             "peer_copies": peer_copies}, "TrainwatchCallback"))
        if every_steps is None:  # the checkpoint library's default: a crash never costs it all
            every_steps = CheckpointConfig().every_steps
        elif every_steps == 0:
            log.warning("trainwatch: TrainwatchCallback(every_steps=0) saves no checkpoint on a "
                        "schedule, only on request and on SIGTERM: a crash restarts from the "
                        "newest of those, or from the beginning")
        self.every_steps, self.keep_last = every_steps, keep_last
        self.replica_every = replica_every  # parameter digests across replicas (docs/sdc.md)
        self.telemetry_options = telemetry_options(telemetry, "TrainwatchCallback",
                                                   ("run_dir", "every_steps", "keep_last",
                                                    "replica_every", *SNAPSHOT_OPTIONS))
        self.tel: Telemetry | None = None
        self._requested = threading.Event()
        self._phase: Any = None
        self._step: Any = None  # open from an optimizer step's first micro-batch to its end
        self._step_number = 0
        self._samples = 0
        self._recorder: Any = None
        self._resumed_from: Path | None = None
        self._stopping = False
        self._term = StopSignal()

    # ------------------------------------------------------------------ resume
    def resume_path(self) -> str | None:
        """For ``trainer.fit(ckpt_path=...)``: the newest verified checkpoint's file (a
        sharded one's folder); with memory snapshots on, a path of this process's that
        ``setup`` fills with the newest snapshot every rank has, when newer, else links to
        that checkpoint (lightning_snapshots.py)."""
        found = newest_verified(self._complete())
        if found is None:
            return None
        self._resumed_from = found[1]
        target = checkpoint_in(found[1], CHECKPOINT_FILE)
        assert target is not None, "_complete lists only folders holding a checkpoint"
        return str(self.snapshots.stage((found[0], target)) or target)

    def _complete(self) -> list[tuple[int, Path]]:
        """(step, folder) of every complete checkpoint of ours, newest first."""
        return [(e.step, e.path) for e in catalog.complete(self.run.checkpoint_dir)
                if e.step is not None and checkpoint_in(e.path, CHECKPOINT_FILE) is not None]

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self.tel is not None:
            return
        self.run.create()
        options = {"rank": trainer.global_rank, "local_rank": trainer.local_rank,
                   "world_size": trainer.world_size, "device": pl_module.device,
                   **self.telemetry_options}
        self.tel = Telemetry.from_env(self.run.root, **options).start()
        self.tel.on_control("checkpoint", lambda path: self._requested.set())
        if any(isinstance(c, TrainwatchCallback) and c is not self for c in trainer.callbacks):
            # after start: the rank's status then says bad input, and it is not restarted
            raise ConfigError("TrainwatchCallback is given twice: each would start its own "
                              "telemetry for the rank and write every checkpoint again; "
                              "keep one", key="callbacks")
        tel = self.tel
        memory = self.snapshots.start(trainer, lambda event, **fields: tel.event(
            event, **{k: v for k, v in fields.items() if v is not None}))
        tel.set_checkpoint(memory_snapshots=memory.facts)
        self.snapshots.resume(pl_module)  # before Lightning loads what resume_path() gave
        if self.replica_every:
            self.tel.check_replicas(pl_module, every=self.replica_every)
        if trainer.global_rank == 0:
            catalog.remove_incomplete(self.run.checkpoint_dir)

    def _telemetry(self) -> Telemetry:
        if self.tel is None:
            raise RuntimeError("TrainwatchCallback: used before Trainer.fit set it up")
        return self.tel

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Lightning's SIGTERM handler (installed just before) runs a broadcast inside the
        # handler; a repeated SIGTERM then broke the ranks' collectives mid-save. Ours only
        # sets a flag; Lightning's forwarding to the processes it spawned is kept.
        launcher = trainer.strategy.launcher
        self._term = StopSignal(launcher.kill if launcher is not None else None)
        self._term.install()
        if trainer.global_rank == 0:
            self._note_resume(trainer.ckpt_path, trainer.global_step)
        self.snapshots.loaded()

    def _note_resume(self, used: str | None, step: int) -> None:
        """Journal a resume from our checkpoint; say so when fit resumed from another
        file (``ckpt_path="last"``, a ModelCheckpoint's) or from none while ours exist: a
        restart then repeats the steps since, and roll-backs do not reach that file."""
        ours = self._resumed_from
        if ours is None:  # resume_path() not called: the newest, not verified (no cost)
            complete = self._complete()
            ours = complete[0][1] if complete else None
        if ours is None:
            return
        mine = checkpoint_in(ours, CHECKPOINT_FILE) or ours / CHECKPOINT_FILE
        given = self.snapshots.staged or mine  # what resume_path() returned
        if used is not None and Path(used).resolve() in (given.resolve(), mine.resolve()):
            said = (self.snapshots.journaled or {}) if Path(used) == given else {}
            fields = (said if "state_from" in said else
                      {"step": step, "path": str(ours), "state_from": "checkpoint", **said})
            self._telemetry().event("checkpoint_resumed", framework="lightning",
                                    **{k: v for k, v in fields.items() if v is not None})
            return
        log.warning("trainwatch: trainer.fit resumed from %s, not from trainwatch's newest "
                    "checkpoint %s: a restart repeats the steps since; pass "
                    "ckpt_path=cb.resume_path()", used or "nothing (ckpt_path=None)",
                    mine)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._close(FINISHED)
        self._term.restore()  # a no-op unless fit ended without Lightning's teardown

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Lightning sees the exception first: a ConfigError is bad input (not restarted)
        failure = ({"kind": BAD_INPUT, "message": str(exception)[:2000]}
                   if isinstance(exception, ConfigError) else None)
        self._close(STOPPED if self._stopping else FAILED, failure)
        # SIGTERM stays ours: Lightning's teardown, next, puts back the handlers from before
        # fit. Given back here, Lightning's (a broadcast inside the handler) took the late
        # SIGTERM of a rank carrying out another rank's stop, and the rank died or hung
        # before writing 'stopped' (the Checkpoints API's fd15d22, for the callback).

    def _close(self, state: str, failure: dict[str, Any] | None = None) -> None:
        self.snapshots.close(finished=state == FINISHED)
        if self.tel is not None:
            self._leave_phase()
            self.tel.close(state, failure=failure)
            self.tel = None

    # ------------------------------------------------------------------ the step
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        if self._step is None:  # the first micro-batch of an optimizer step
            self._step_number = trainer.global_step
            self._step = self._telemetry().step(self._step_number)
            self._recorder = self._step.__enter__()
            self._samples = 0
        self._enter_phase("forward")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        self._enter_phase("backward")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self._leave_phase()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._enter_phase("optimizer")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._leave_phase()
        if self._step is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        values: dict[str, Any] = {}
        if isinstance(loss, torch.Tensor):
            values["loss"] = loss.detach()
        norm = trainer.callback_metrics.get("grad_norm")
        if isinstance(norm, torch.Tensor):
            values["grad_norm"] = norm
        self._samples += batch_size(batch) or 0
        if self._samples:
            values["samples"] = self._samples
        self._recorder.record(**values)
        stepped = trainer.global_step != self._step_number  # else still accumulating
        if stepped:
            self._step.__exit__(None, None, None)
            self._step = None
        self._maybe_save(trainer, stepped)
        if stepped:
            self.snapshots.after_step(trainer)

    # ------------------------------------------------------------------ checkpoints
    def _maybe_save(self, trainer: Any, stepped: bool) -> None:
        """Save when due, asked or stopping, at an optimizer step's end: a save between
        micro-batches would hold a half-accumulated step; only a stop takes one (Lightning
        stops after this batch)."""
        step = trainer.global_step
        stopping = self._term.asked.is_set() or bool(trainer.received_sigterm)
        requested = self._requested.is_set() or stopping
        if trainer.world_size > 1:  # every rank must save at the same step
            requested = trainer.strategy.reduce_boolean_decision(requested, all=False)
            if requested:  # the same on every rank: all of them take this second vote
                stopping = trainer.strategy.reduce_boolean_decision(stopping, all=False)
        due = stepped and interval_due(step, self.every_steps)
        if not (due or stopping or (requested and stepped)):
            return  # a request mid-accumulation waits for the step's end
        self._requested.clear()
        self._stopping = stopping
        with self._telemetry().phase("checkpoint"):
            folder = self.run.checkpoint_dir
            tmp = folder / f".tmp-{step_dir_name(step)}-lightning"
            if trainer.global_rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            trainer.save_checkpoint(str(tmp / CHECKPOINT_FILE))  # every rank; rank 0 writes
            if trainer.global_rank == 0:  # a sharded save's folder: every rank's shard is in
                flatten(tmp / CHECKPOINT_FILE, type(trainer.strategy).__name__)
                reason = "stop" if stopping else "request" if requested else "interval"
                self._publish(tmp, folder / step_dir_name(step), step, trainer.world_size,
                              reason)
        if stopping:  # saved: every rank stops here, "stopped, resume me" (not exit 0)
            raise SIGTERMException(EXIT_STOPPED)

    def _publish(self, tmp: Path, final: Path, step: int, world_size: int, reason: str) -> None:
        seal(tmp, step, world_size=world_size, framework="lightning")
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        size = sum(p.stat().st_size for p in final.iterdir())
        tel = self._telemetry()
        tel.checkpoint_saved(final, step, verified=True, bytes=size, reason=reason,
                                  framework="lightning")
        for entry, why in retention.to_prune(catalog.scan(final.parent),
                                             keep_last=self.keep_last, keep_best=0,
                                             newest_verified=final):
            shutil.rmtree(entry.path, ignore_errors=True)
            tel.event("checkpoint_pruned", step=entry.step, path=str(entry.path),
                           reason=why)

    # ------------------------------------------------------------------ phases
    def _enter_phase(self, name: str) -> None:
        self._leave_phase()
        self._phase = self._telemetry().phase(name)
        self._phase.__enter__()

    def _leave_phase(self) -> None:
        if self._phase is not None:
            self._phase.__exit__(None, None, None)
            self._phase = None

