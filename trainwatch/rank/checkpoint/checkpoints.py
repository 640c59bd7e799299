"""Checkpoints for any training loop: the reference trainer's checkpointer behind four calls.

    ckpt = Checkpoints.from_env()                          # RUN_DIR from the environment
    start = ckpt.resume(model=model, optimizer=opt)        # newest verified; 0 when none
    for step in range(start, steps):
        if ckpt.should_skip(step):                         # a rollback dropped this batch
            continue
        ...
        ckpt.maybe_save(step + 1, model=model, optimizer=opt)
    ckpt.close()                                           # waits; saves the final step

Everything the trainer's checkpoints do comes with it, because it is the same
``Checkpointer``: atomic ``step-N`` folders with a manifest of file digests, async saves, retention,
a mirror copy, resume from the newest checkpoint that verifies (falling back past bad
ones), saves on SIGUSR1 or ``control/checkpoint``, and on SIGTERM a save and a clean exit
(``EXIT_STOPPED``). State is passed by keyword: anything with ``state_dict`` /
``load_state_dict`` (model, optimizer, scheduler, a stateful loader), plain data, or any
picklable object; ``data=`` is per rank (each rank's loader position), the rest is taken
from rank 0. Every rank's RNGs are saved and restored without being asked.

A sharded model (FSDP2's ``fully_shard``: DTensor parameters; FSDP1's
``FullyShardedDataParallel``: its sharded state dict) is seen at the first call and saved
through torch.distributed.checkpoint, every rank writing its own shards (sharded.py,
sharded_save.py); resume reshards it when the world size changed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainwatch.contract.env import DEFAULT_RUN_DIR, RUN_DIR_ENV
from trainwatch.errors import ConfigError
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rank import telemetry as telemetry_mod
from trainwatch.checkpoint_format.manifest import LAYOUT_DCP
from trainwatch.rank.checkpoint import sharded
from trainwatch.rank.checkpoint.checkpointer import EXIT_STOPPED, Checkpointer
from trainwatch.rank.checkpoint.config import CheckpointConfig
from trainwatch.rank.checkpoint.resume import Restored
from trainwatch.rank.memory_snapshots.live import Live
from trainwatch.rank.checkpoint.whole_state import (UnsaveableState, check_objects,
                                                     check_trees, is_fsdp1)
from trainwatch.rank.skips import (SkipSteps, agree_skip_steps, skip_steps_from,
                                   skip_steps_message)

log = logging.getLogger(__name__)

# A picklable object without state_dict is stored as its pickle in a byte tensor, so the
# checkpoint still loads with torch.load(weights_only=True).
_PICKLED = "__trainwatch_pickled__"
_PLAIN = (int, float, str, bool, bytes, type(None), torch.Tensor)
FSDP1_NO_SNAPSHOTS = ("FSDP1 (FullyShardedDataParallel) state: memory snapshots hold FSDP2 "
                      "(DTensor) shards only; its durable checkpoints are saved through DCP "
                      "(shard with fully_shard to have snapshots too)")


class Checkpoints:
    """Resume, save on schedule / on request / on SIGTERM, and rollback skips for one rank."""

    def __init__(self, run_dir: str | Path, config: CheckpointConfig | None = None, *,
                 telemetry: Any = None):
        self.run = RunDir(run_dir).create()
        self.config = config or CheckpointConfig()
        self.telemetry = telemetry if telemetry is not None else telemetry_mod.current()
        self.checkpointer = Checkpointer(self.config, self.run.root, telemetry=self.telemetry)
        self.restored: Restored | None = None
        # Restored values that could not be loaded in place (no load_state_dict, not a
        # dict or list): name -> value.
        self.loaded: dict[str, Any] = {}
        self._skip: SkipSteps | None = None
        self._skipped: list[int] = []
        self._last: tuple[int, dict[str, Any]] | None = None
        self._saved_at: int | None = None
        self._closed = False
        self._checked: set[str] = set()  # "resume", "save": the state was looked at once
        self._sharded = False  # the state is sharded (DTensor, FSDP1): DCP saves and loads it
        self.checkpointer.start()

    @classmethod
    def from_env(cls, run_dir: str | Path | None = None, *, telemetry: Any = None,
                 **settings: Any) -> "Checkpoints":
        """The run directory from ``$TRAINWATCH_RUN_DIR`` (set by ``trainwatch run``; else
        the started telemetry's), the telemetry this process started, and any ``checkpoint`` setting by keyword
        (``every_steps=50, keep_last=2, mirror_dir=...``; docs/checkpoints.md).

        Call on every rank, after ``init_process_group``.
        """
        telemetry = telemetry if telemetry is not None else telemetry_mod.current()
        run_dir = (run_dir or os.environ.get(RUN_DIR_ENV)
                   or (telemetry.run.root if telemetry is not None else DEFAULT_RUN_DIR))
        config = CheckpointConfig.from_mapping(settings, file="Checkpoints.from_env()",
                                               prefix="Checkpoints.from_env")
        return cls(run_dir, config, telemetry=telemetry)

    @property
    def rank(self) -> int:
        return self.checkpointer.rank

    @property
    def exit_code(self) -> int:
        return self.checkpointer.exit_code

    # ------------------------------------------------------------------ resume
    def resume(self, **state: Any) -> int:
        """Load the newest verified checkpoint into ``state`` (every rank the same one);
        returns the step to continue from, 0 when there is none.

        Objects with ``load_state_dict`` are loaded in place, dicts and lists updated in
        place; anything else is in ``self.loaded[name]``. RNGs are restored last, so call
        this after building the model and optimizer, just before the loop. Sharded state
        (FSDP2's DTensors, FSDP1's sharded state dict) is loaded through DCP, resharded to
        this world size; other tensor subclasses are refused: a ConfigError, bad input
        (whole_state.py).
        """
        self._check_once("resume", state)
        objects = {k: v for k, v in state.items() if k != "data"}
        # a memory snapshot of sharded state is checked against the model's DTensors
        live = (lambda: sharded.models_of(objects)) if self._sharded else None
        # the skip request comes with the durable checkpoint's decision, if one is made
        self.checkpointer.tell = lambda: skip_steps_message(self.run)
        restored = self.checkpointer.resume(live)
        self._agree_skips(self.checkpointer.told)
        if restored is None:
            return 0
        self._continue_at(restored.step)
        self.restored = restored
        values = restored.shared
        held = set(restored.manifest.get("shared") or ())  # a key added since: warned
        put_back = False  # models and optimizers loaded by torch's set_*_state_dict
        if restored.manifest.get("layout") == LAYOUT_DCP:
            values = sharded.load(restored.path, {k: v for k, v in state.items() if k in held},
                                  self.checkpointer.group)
            put_back = True
        elif restored.manifest.get("sharded"):  # this rank's shards, from a memory snapshot
            sharded.put_back({k: v for k, v in objects.items() if k in held}, values)
            put_back = True
        elif self._sharded:
            raise ConfigError(
                "a data-parallel checkpoint (whole model.pt) cannot be loaded into this "
                "sharded (DTensor) model yet: resume it without fully_shard, or start a new "
                "run directory", file=str(restored.path))
        for name, target in state.items():
            if name == "data":
                value = restored.data
            elif isinstance(target, (torch.nn.Module, torch.optim.Optimizer)) and (
                    put_back) and name in values:
                self.loaded[name] = values[name]  # set_state_dict loaded it (sharded.py)
                continue
            elif name in values:
                value = values[name]
            else:
                log.warning("trainwatch checkpoint %s holds no %r; left as it is",
                            restored.path, name)
                continue
            self._load_into(name, target, _unwrap(value))
        restored.restore_rng()
        return restored.step

    def _load_into(self, name: str, target: Any, value: Any) -> None:
        if hasattr(target, "load_state_dict"):
            target.load_state_dict(value)
        elif isinstance(target, dict) and isinstance(value, dict):
            target.clear()
            target.update(value)
        elif isinstance(target, list) and isinstance(value, list):
            target[:] = value
        self.loaded[name] = value

    # ------------------------------------------------------------------ in the loop
    def should_skip(self, step: int) -> bool:
        """True for a step a rollback asked to drop (its batch held a NaN or a spike):
        don't train it. The same answer on every rank."""
        window = self._skip if self._skip is not None else self._agree_skips()
        skip = step in window
        if skip:
            self._continue_at(step + 1)
            self._skipped.append(step)
            if step == window.last:
                self._journal_skipped()
        return skip

    def maybe_save(self, step: int, **state: Any) -> bool:
        """Save if due: every ``every_steps``, on SIGUSR1 or ``control/checkpoint``, and on
        SIGTERM (then telemetry is closed and the process exits with ``EXIT_STOPPED``).

        ``step`` is the number of steps completed. Call on every rank at the same steps
        (ranks agree on requests here); returns True when a save started.
        """
        self._last = (step, state)
        self._continue_at(step)
        self._check_once("save", state)  # before the first memory snapshot looks at it
        saving = []

        def taken() -> dict[str, Any]:
            saving.append(True)
            return self._trees(state)

        # a memory snapshot is not a save: the final save must still come (close)
        def data() -> Any:  # the rank's data position alone, kept every step
            return _state_dicts({"data": state["data"]})["data"] if "data" in state else None

        # not sharded: the snapshot may read the live tensors (memory_snapshots/live.py)
        live = None if self._sharded else Live(state, _state_dicts)
        if self.checkpointer.after_step(step, taken, snapshot_state=lambda: self._trees(state),
                                        data=data, snapshot_live=live):
            self._stop()
        if saving:
            self._saved_at = step
        return bool(saving)

    def note_metrics(self, **metrics: float) -> None:
        """Validation results stored with the next checkpoint (``val_loss`` drives keep_best)."""
        self.checkpointer.note_metrics(**metrics)

    def wait(self) -> None:
        """Wait for the save in flight."""
        self.checkpointer.wait()

    def close(self, *, final: bool = True) -> None:
        """Save the last step the loop reported (if it was not just saved), wait for the
        writer, stop handling signals. Call on every rank at the end of training."""
        if self._closed:
            return
        self._closed = True
        if self._skipped and self._skip is not None and self._skipped[-1] != self._skip.last:
            self._journal_skipped()
        if final and self._last is not None and self._saved_at != self._last[0]:
            step, state = self._last
            self.checkpointer.after_step(step, lambda: self._trees(state), final=True)
        if final:
            self.checkpointer.memory.run_finished()  # nothing left to resume: freed
        self.checkpointer.close()

    def __enter__(self) -> "Checkpoints":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(final=exc_type is None)  # a failing rank must not start a collective

    # ------------------------------------------------------------------ internals
    def _check_once(self, when: str, state: dict[str, Any]) -> None:
        """Refuse unsaveable state (tensor subclasses) before it is saved or loaded into,
        and notice sharded (DTensor, FSDP1) state, once. FSDP1 turns memory snapshots off:
        they hold DTensor shards only (and FSDP1's optimizer state dict is a collective)."""
        if when not in self._checked and self.config.enabled:
            self._sharded = check_objects(state) or self._sharded
            self._checked.add(when)
            memory = self.checkpointer.memory
            if memory.enabled and any(isinstance(v, torch.nn.Module) and is_fsdp1(v)
                                      for v in state.values()):
                # every rank the same, before the snapshots start (their ranks agree then)
                memory.facts.update(enabled=False, off_reason=FSDP1_NO_SNAPSHOTS)

    def _trees(self, state: dict[str, Any]) -> dict[str, Any]:
        """What a save writes: DCP state dicts when sharded, else each object's state
        (the state is looked at first, once: a final save may be the first)."""
        self._check_once("save", state)
        if not self._sharded:
            return _state_dicts(state)
        trees = sharded.state_dicts(state)
        if "data" in state:
            trees["data"] = _state_dicts({"data": state["data"]})["data"]
        return trees

    def _continue_at(self, step: int) -> None:
        if self.telemetry is not None and hasattr(self.telemetry, "continue_at"):
            self.telemetry.continue_at(step)

    def _agree_skips(self, told: Any = None) -> SkipSteps:
        """The rollback's skip window, the same on every rank: ``told`` with the resume's
        decision (rank 0's ``skip_steps_message``), else agreed here."""
        if told is not None:
            self._skip = skip_steps_from(told)
            return self._skip
        distributed = dist.is_available() and dist.is_initialized()
        self._skip = agree_skip_steps(self.run, distributed)
        return self._skip

    def _journal_skipped(self) -> None:
        if self.rank == 0 and self._skipped:
            fields = {"steps": list(self._skipped),
                      "reason": self._skip.reason if self._skip is not None else None}
            if self.telemetry is not None:
                self.telemetry.event("data_skipped", **fields)
            else:
                try:
                    self.run.append_event("data_skipped", "rank0", rank=0, **fields)
                except OSError as exc:  # the journal may sit on a full disk: never the job
                    log.warning("trainwatch: could not journal data_skipped: %s", exc)
        self._skipped = []

    def _stop(self) -> None:
        """SIGTERM was honoured with a checkpoint: end this rank the way the trainer does.
        SIGTERM stays handled until the final status is written: the launcher's SIGTERM of a
        rank that stops because another rank was asked lands about now, and unhandled it
        killed the rank with its status still ``running``."""
        self.checkpointer.close(signals=False)
        self._closed = True
        if self.telemetry is not None:
            self.telemetry.close("stopped")
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        self.checkpointer.requests.uninstall()
        with contextlib.suppress(OSError, ValueError):  # a full disk's or a closed stderr
            print(f"trainwatch: rank {self.rank}: stopped on request after saving step "
                  f"{self._last[0] if self._last else '?'}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_STOPPED)


def _state_dicts(state: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, value in state.items():
        if hasattr(value, "state_dict"):
            out[name] = value.state_dict()
        elif _plain(value):
            out[name] = value
        else:
            out[name] = {_PICKLED: torch.frombuffer(bytearray(_pickled(name, value)),
                                                    dtype=torch.uint8)}
    return out


def _pickled(name: str, value: Any) -> bytes:
    try:
        return pickle.dumps(value)
    except Exception as exc:  # bad input (exit 2), not an error that a restart repeats
        check_trees({name: value})  # a container: name the key inside it that failed
        kind = type(value)
        raise UnsaveableState(
            name, f"{kind.__module__}.{kind.__qualname__} has no state_dict() and cannot be "
                  f"pickled ({type(exc).__name__}: {exc})",
            "pass its state as plain values, or give it state_dict() and load_state_dict()"
        ) from None


def _plain(value: Any) -> bool:
    """Loads with ``weights_only=True`` as it is (tensors, numbers, strings, containers)."""
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return all(_plain(v) for v in value)
    if type(value) is dict:
        return all(isinstance(k, (str, int)) and _plain(v) for k, v in value.items())
    return False


def _unwrap(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {_PICKLED}:
        return pickle.loads(value[_PICKLED].numpy().tobytes())  # the job's own run directory
    return value
