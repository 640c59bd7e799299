"""Hugging Face ``Trainer``: telemetry, verified checkpoints and checkpoint-now requests.

    from trainwatch.integrations.transformers import TrainwatchCallback
    cb = TrainwatchCallback()
    trainer = Trainer(model, args, callbacks=[cb], ...)
    trainer.train(resume_from_checkpoint=cb.resume_path(args.output_dir))   # None when none

Per rank: steps and forward/backward/optimizer phases from hooks on the model and the
optimizer (``tel.watch``), and the loss and gradient norm the Trainer already logs
(``logging_steps``; plain floats it computed: no extra device sync), and each step's
samples (the batches of its training forwards: throughput). A touch of
``RUN_DIR/control/checkpoint`` (CheckpointTooOld's action) makes the Trainer save at the
next step (``control.should_save``; the ranks agree with one small all-reduce per step);
every ``checkpoint-N`` folder it saves is sealed with a trainwatch manifest once all
ranks wrote their files, and ``resume_path`` is the newest that verifies. ``output_dir`` is
recorded as the run's checkpoint folder (run.json), so the controller, ``trainwatch
checkpoint list|verify RUN_DIR`` and the run's summary see those checkpoints. On SIGTERM the
ranks agree to save at the step's end and stop; the process then exits 75 (stopped after a
checkpoint). ``replica_every=N`` digests the model's parameters every N steps for the
replica check (docs/sdc.md). With FSDP only FULL_STATE_DICT checkpoints can be sealed: a
sharded one (folders inside ``checkpoint-N``) stops the run with exit 2 at its first save
(docs/own-trainer.md, "Sharded models with Lightning / Hugging Face"). Needs
``transformers`` (and ``accelerate``) installed.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from trainwatch.contract.env import run_dir_from_env
from trainwatch.integrations.batches import batch_size
from trainwatch.integrations.options import SNAPSHOT_OPTIONS, snapshot_options, telemetry_options
from trainwatch.integrations.sealed import newest_verified, seal
from trainwatch.integrations.stopsignal import StopSignal
from trainwatch.integrations.transformers_snapshots import TrainerSnapshots
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rank.checkpoint.checkpointer import EXIT_STOPPED
from trainwatch.checkpoint_format.manifest import FRAMEWORK_STEP_DIR
from trainwatch.rank.telemetry import Telemetry

log = logging.getLogger(__name__)
# FSDP's SHARDED_STATE_DICT makes the Trainer write folders (pytorch_model_fsdp_0/,
# optimizer_0/) into checkpoint-N/; sealing refuses them (exit 2) with this way out.
SHARDED_FIX = ("With FSDP, set fsdp_config={'state_dict_type': 'FULL_STATE_DICT'} (the "
               "Trainer then saves the whole model and optimizer as files), or save sharded "
               "state with trainwatch's Checkpoints in your own loop (docs/own-trainer.md)")


class TrainwatchCallback(TrainerCallback):
    """Telemetry and verified, requestable checkpoints for a Hugging Face ``Trainer``."""

    def __init__(self, run_dir: str | Path | None = None, *, replica_every: int = 0,
                 memory_snapshots: str = "auto", memory_snapshots_dir: str | None = None,
                 peer_copies: str = "ring", **telemetry: Any):
        self.run = RunDir(run_dir or run_dir_from_env())
        self.snapshots = TrainerSnapshots(self.run, snapshot_options(
            {"memory_snapshots": memory_snapshots, "memory_snapshots_dir": memory_snapshots_dir,
             "peer_copies": peer_copies}, "TrainwatchCallback"))
        self.replica_every = replica_every  # parameter digests across replicas (docs/sdc.md)
        self.telemetry_options = telemetry_options(telemetry, "TrainwatchCallback",
                                                   ("run_dir", "replica_every", *SNAPSHOT_OPTIONS))
        self.tel: Telemetry | None = None
        self._requested = threading.Event()
        self._term = StopSignal()
        self._stopping = False
        self._counting: Any = None  # the forward pre-hook counting a step's samples
        self._samples = 0
        self._resumed_from: tuple[int, Path] | None = None  # what resume_path() found

    def resume_path(self, output_dir: str | Path) -> str | None:
        """The newest ``checkpoint-N`` in ``output_dir`` whose manifest verifies; with
        memory snapshots on, after ``Trainer(...)`` (every rank: the ranks agree), a folder
        of this process's holding the newest snapshot every rank has, when newer
        (transformers_snapshots.py)."""
        candidates = []
        folder = Path(output_dir)
        if folder.is_dir():
            for child in folder.iterdir():
                match = FRAMEWORK_STEP_DIR.match(child.name)
                if match and child.is_dir():
                    candidates.append((int(match.group(1)), child))
        found = newest_verified(candidates)
        self._resumed_from = found
        staged = self.snapshots.resume(found[0] if found is not None else None)
        if staged is not None:
            return str(staged)
        return str(found[1]) if found is not None else None

    # ------------------------------------------------------------------ lifecycle
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.snapshots.joined(args)  # the ranks joined: resume_path may agree on a snapshot

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        self.run.create()
        options = {"rank": args.process_index, "local_rank": args.local_process_index,
                   "world_size": args.world_size, "device": args.device,
                   **self.telemetry_options}
        self.tel = Telemetry.from_env(self.run.root, **options).start()
        self.tel.on_control("checkpoint", lambda path: self._requested.set())
        if state.is_world_process_zero:
            # The Trainer's output_dir is this run's checkpoint folder: the controller,
            # `trainwatch checkpoint list|verify RUN_DIR` and the summary look there.
            self.run.record_checkpoint_folders([Path(args.output_dir)])
        tel = self.tel
        memory = self.snapshots.attach(lambda event, **fields: tel.event(event, **fields))
        tel.set_checkpoint(memory_snapshots=memory.facts)
        self._term.install()
        if model is not None:  # every training forward's batch, for the step's samples
            self._counting = model.register_forward_pre_hook(self._count, with_kwargs=True)
        if model is not None and optimizer is not None:
            # The torch optimizer inside accelerate's wrapper runs the step hooks.
            self.tel.watch(model, getattr(optimizer, "optimizer", optimizer),
                           first_step=state.global_step)
        if model is not None and self.replica_every:
            self.tel.check_replicas(model, every=self.replica_every)
        if state.is_world_process_zero:
            self._note_resume(state.global_step)

    def _note_resume(self, step: int) -> None:
        """Journal a resume from what ``resume_path`` gave (a snapshot or the checkpoint);
        say so when ``train`` was given another one (or none): the Trainer starts at the
        step of what it loaded, so a different step is a different start."""
        said = self.snapshots.journaled or {}
        memory = self.snapshots.restored
        ours = (memory.step, memory.path) if memory is not None else self._resumed_from
        if ours is None or self.tel is None:
            return
        if step == ours[0]:
            fields = (said if memory is not None else
                      {"step": step, "path": str(ours[1]), "state_from": "checkpoint", **said})
            self.tel.event("checkpoint_resumed", framework="transformers",
                           **{k: v for k, v in fields.items() if v is not None})
            return
        log.warning("trainwatch: trainer.train started at step %d, not from the newest "
                    "state %s (step %d): a restart repeats the steps since; pass "
                    "resume_from_checkpoint=cb.resume_path(args.output_dir)",
                    step, ours[1], ours[0])

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._counting is not None:
            self._counting.remove()
            self._counting = None
        self.snapshots.close(finished=not self._stopping)
        if self.tel is not None:
            self.tel.close("stopped" if self._stopping else "finished")
            self.tel = None
        if self._stopping:  # saved; "stopped, resume me", not "finished"
            # SIGTERM stays ours to the exit: given back before the final status, the
            # late SIGTERM of a rank carrying out another rank's stop (its launcher's)
            # killed it before it wrote 'stopped' (the Lightning callback's f544fb9).
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()  # else exiting waits on the group's peers
            raise SystemExit(EXIT_STOPPED)
        self._term.restore()  # finished: the script goes on with its own handler

    # ------------------------------------------------------------------ the step
    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None,
               **kwargs: Any) -> None:
        if self.tel is None or not logs or "loss" not in logs:
            return
        values = {"loss": logs["loss"]}
        if isinstance(logs.get("grad_norm"), (int, float)):
            values["grad_norm"] = logs["grad_norm"]
        if isinstance(logs.get("learning_rate"), (int, float)):
            values["lr"] = logs["learning_rate"]
        self.tel.record(**values)

    def _count(self, module: Any, args: Any, kwargs: Any) -> None:
        if module.training and torch.is_grad_enabled():  # not an evaluation's forward
            self._samples += batch_size(kwargs or args) or 0

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.tel is not None and self._samples:  # the step just ended: all micro-batches
            self.tel.record(samples=self._samples)
        self._samples = 0
        requested, stopping = self._requested.is_set(), self._term.asked.is_set()
        if args.world_size > 1 and dist.is_available() and dist.is_initialized():
            flags = torch.tensor([float(requested), float(stopping)], device=args.device)
            dist.all_reduce(flags)  # every rank must save (and stop) at the same step
            requested, stopping = (value > 0 for value in flags.tolist())
        if requested or stopping:
            self._requested.clear()
            control.should_save = True
        if stopping:  # SIGTERM: save this step, then end training and exit 75
            self._stopping = True
            control.should_training_stop = True
        self.snapshots.after_step(state, kwargs.get("model"), kwargs.get("optimizer"),
                                  kwargs.get("lr_scheduler"))

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if args.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank has written its own files (its RNG state)
        if not state.is_world_process_zero or self.tel is None:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if not folder.is_dir():
            return
        seal(folder, state.global_step, world_size=args.world_size, framework="transformers",
             folders=SHARDED_FIX, key="fsdp_config")
        size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
        self.tel.checkpoint_saved(folder, state.global_step, verified=True, bytes=size,
                                  framework="transformers")
