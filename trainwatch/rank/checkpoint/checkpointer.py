"""The checkpoint component a training loop talks to.

    ckpt = Checkpointer(cfg.checkpoint, run_dir, telemetry=tel, config_hash=h).start()
    restored = ckpt.resume()                       # None on a fresh run
    if restored:
        model.load_state_dict(restored.shared["model"]); ...; loader.load_state_dict(restored.data)
        restored.restore_rng()
    for step in range(start, steps):
        ...backward...
        if ckpt.check_step(step, loss, grad_norm, data=loader.state_dict):  # finite on all ranks?
            opt.step(); sched.step()
        opt.zero_grad()
        if ckpt.after_step(step + 1, training_state):   # saved if due; True: stop (SIGTERM)
            break
    ckpt.close()
    sys.exit(ckpt.exit_code)

``training_state()`` returns ``{"model": ..., "optimizer": ..., "scheduler": ..., "data": ...}``:
every key but ``data`` is the same on every rank and written once, by rank 0; ``data``
(the loader position) and the RNG states are per rank and gathered to rank 0.
Only rank 0 writes. Trees holding DTensors (FSDP2) are sharded instead: every rank writes
its own shards through DCP and rank 0 seals them (sharded_save.py); such a loop passes
``ckpt.resume(live)`` its model's DTensors (``sharded.models_of``) so a memory snapshot of
its shards can be checked and loaded (memory_snapshots/shards.py).
See docs/checkpoints.md.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from trainwatch.contract.layout import rank_source
from trainwatch.errors import ConfigError
from trainwatch.rundir.run_dir import RunDir
from trainwatch.checkpoint_format import catalog
from trainwatch.rank.checkpoint import resume as resume_mod, retention, rng, whole_state
from trainwatch.rank.checkpoint.sharded_save import host_stager, stage, write_sharded
from trainwatch.rank.checkpoint.cadence import interval_due
from trainwatch.rank.checkpoint.config import CheckpointConfig
from trainwatch.checkpoint_format.manifest import verify
from trainwatch.rank.checkpoint.early_digests import EarlyDigests
from trainwatch.rank.checkpoint.parallel_verify import ParallelVerify
from trainwatch.rank.checkpoint.nonfinite import (NonFiniteHalt, nonfinite_flag,
                                                     nonfinite_state)
from trainwatch.rank.checkpoint.requests import Requests
from trainwatch.rank.checkpoint.snapshot import Handoff, HostSnapshot
from trainwatch.rank.checkpoint.writer import (CheckRefused, Payload, Written,
                                                  copy_checkpoint, write_checkpoint)
from trainwatch.rank.memory_snapshots import gasp_request, peer_resume
from trainwatch.rank.memory_snapshots.dying_gasp import DyingGasp
from trainwatch.rank.memory_snapshots.peer_link import settings_from as peer_settings
from trainwatch.rank.memory_snapshots.snapshotter import MemorySnapshots, for_run

log = logging.getLogger(__name__)

# Exit code of a rank that stopped on SIGTERM after saving a checkpoint (EX_TEMPFAIL:
# "try again later"); rerunning the same command resumes from that checkpoint.
EXIT_STOPPED = 75


class Checkpointer:
    """Saves (async or sync), resumes, prunes, answers requests, guards against NaN/Inf."""

    def __init__(self, config: CheckpointConfig, run_dir: str | Path, *, telemetry: Any = None,
                 config_hash: str | None = None, rank: int | None = None,
                 world_size: int | None = None, sharded: bool | None = None):
        self.cfg = config
        # whether this run's model is sharded, when the caller knows (the reference trainer's
        # parallel.mode): a checkpoint of the other kind is refused before it is loaded
        self.expect_sharded = sharded
        self.run = RunDir(run_dir)
        self.telemetry = telemetry
        self.config_hash = config_hash
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else (rank or 0)
        self.world_size = dist.get_world_size() if self.distributed else (world_size or 1)
        folders = self.run.configured_checkpoint_folders(config.dir, config.mirror_dir)
        self.folder, self.mirror = folders[0], (folders[1] if len(folders) > 1 else None)
        self.requests = Requests()
        self.exit_code = 0
        self._group = None
        if self.distributed and self.world_size > 1:
            # Gathers and broadcasts of small Python objects go over gloo, off the GPU.
            self._group = (dist.group.WORLD if dist.get_backend() == "gloo"
                           else dist.new_group(backend="gloo"))
        self._snapshot = HostSnapshot()
        self._writer: threading.Thread | None = None
        self._lock = threading.Lock()
        self._metrics: dict[str, float] = {}
        self._agreed: tuple[int, bool, bool, list[str]] | None = None
        self._newest_verified: dict[Path, Path] = {}
        self._scanned: dict[Path, list[Any]] = {}  # rank 0's listing at resume, kept for _choose
        # What rank 0 tells every rank with a durable resume's decision (the caller's, e.g.
        # Checkpoints' skip request: no collective of its own), and what it told.
        self.tell: Callable[[], Any] | None = None
        self.told: Any = None
        self._telling: Any = None
        self._state_checked = False  # the first save looks at the state once (whole_state.py)
        self._sharded = False  # it holds DTensors: saved through DCP (sharded_save.py)
        self._stager: Any = None  # DCP's stager of sharded state kept between saves (GPU)
        self._writer_group: Any = None  # the gloo group an async sharded writer uses
        self.facts: dict[str, Any] = {
            "step": None, "path": None, "time": None, "ok": None, "bytes": None,
            "last_error": None, "in_flight": False, "saves_total": 0, "failures_total": 0,
            "skipped_total": 0, "nonfinite_skipped_total": 0}
        # In-memory snapshots every step or so: a restart loses at most one step
        # (docs/memory-snapshots.md); their facts are published with the checkpoint's.
        self.memory: MemorySnapshots = for_run(
            config.memory_snapshots if config.enabled else "off", config.memory_snapshots_dir,
            self.run.root, rank=self.rank, world_size=self.world_size, group=self._group,
            config_hash=config_hash, journal=self._journal, is_sharded=self._is_sharded,
            every=config.memory_snapshots_every, durable_every_steps=config.every_steps,
            peers=peer_settings(config.peer_copies, config.peer_copies_offset,
                                config.peer_copies_clique_size, config.peer_copies_nodes))
        self.facts["memory_snapshots"] = self.memory.facts
        # a failed replica's teardown writes its step if still whole (dying_gasp.py)
        self.gasp = DyingGasp(self.memory)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "Checkpointer":
        """Handle SIGUSR1/SIGTERM and the control file; clear what crashed saves left."""
        if not self.cfg.enabled:
            return self
        self.requests.install(self.telemetry)
        if self.telemetry is not None:  # the supervisor's ask before it kills a stalled job
            gasp_request.listen(self.telemetry, self.gasp, self.rank)
        if self.rank == 0:
            self._record_folders()
            for folder in filter(None, (self.folder, self.mirror)):
                for path in catalog.remove_incomplete(folder):
                    self._journal("checkpoint_pruned", path=str(path),
                                  reason="incomplete (a save was interrupted)")
        self._publish()  # "checkpointing on, nothing saved yet" is a fact readers need too
        return self

    def _record_folders(self) -> None:
        """Note where checkpoints go in run.json, so diagnose, the agent and
        ``trainwatch checkpoint list`` find them wherever they are."""
        try:
            self.run.record_checkpoint_folders([f for f in (self.folder, self.mirror) if f])
        except OSError as exc:
            log.warning("cannot record the checkpoint folders in %s: %s", self.run.run_file,
                        exc.strerror or exc)

    def close(self, *, signals: bool = True) -> None:
        """Wait for the save in flight, stop handling signals (``signals=False``: the caller
        does, later), publish the final facts."""
        self.wait()
        self.memory.wait()
        if self.exit_code != EXIT_STOPPED and not self.memory._finished:
            failure = sys.exc_info()[1]  # closing in an ``except``: what failed
            self.gasp.gasp(f"{type(failure).__name__}: {failure}"[:300] if failure is not None
                           else "closed before the run finished")
        self.memory.close()
        self.gasp.close(finished=self.memory._finished)
        if signals:
            self.requests.uninstall()
        self._publish()

    @property
    def group(self) -> Any:
        """The gloo group the checkpoint's collectives go over (None for one rank)."""
        return self._group

    def wait(self) -> None:
        writer = self._writer
        if writer is not None:
            writer.join()

    # ------------------------------------------------------------------ resume
    def resume(self, live: Callable[[], dict[str, Any]] | None = None
               ) -> resume_mod.Restored | None:
        """Load the newest verified, compatible checkpoint (every rank the same one), or None.

        ``live``: of a sharded (DTensor) job, its state trees as ``after_step``'s ``state``
        gives them (the model's suffice); a memory snapshot of its shards is checked
        against them and its ``shared`` trees come back as DTensors on the job's mesh."""
        self.told = None
        if not self.cfg.enabled or self.cfg.resume == "never":
            return None
        # while the ranks agree: hashing, the newest manifest, this rank's rank file
        early = EarlyDigests.start(self.folder, self.rank, self.world_size)
        try:
            restored, memory_reason = self._resume_from_memory(live)
            if restored is not None:
                return restored
            decision: dict[str, Any] = {}
            verifier = ParallelVerify(self.rank, self.world_size, self._group, self._decide,
                                      early)
            if self.rank == 0:
                try:  # every rank hashes its share of each candidate rank 0 looks at
                    self._telling = self.tell() if self.tell is not None else None
                    decision = {**self._choose(verifier.verify), "told": self._telling}
                except BaseException as exc:  # the others must not go on without a checkpoint
                    decision = {"error": f"rank 0 failed choosing the checkpoint to resume "
                                         f"({type(exc).__name__}: {exc})",
                                "file": str(self.folder)}
                    raise
                finally:
                    verifier.done(decision)  # the others have it already when one verified
            else:
                decision = verifier.serve()
        finally:
            early.stop()
        self.told = decision.get("told")
        if decision.get("error"):
            raise ConfigError(decision["error"], file=decision.get("file"))
        if not decision.get("path"):
            self.memory.peers.after_resume(None)  # held copies of a lost history go
            return None
        path = Path(decision["path"])
        restored = resume_mod.load(path, decision["manifest"], self.rank, self.world_size,
                                   verifier.take(path))  # what was loaded while hashed
        self.memory.peers.after_resume(restored.step)
        self._newest_verified[path.parent] = path
        if self.rank == 0:
            if restored.resharded is not None:
                self._journal("checkpoint_resharded", step=restored.step, path=str(path),
                              **restored.resharded)
            self._journal("checkpoint_resumed", step=restored.step, path=str(path),
                          data_position=decision["manifest"].get("data_position"),
                          state_from="checkpoint", memory_snapshot=memory_reason)
        with self._lock:
            self.facts.update(step=restored.step, path=str(path), ok=True,
                              time=decision["manifest"].get("created_at"))
        self._publish()
        return restored

    def _resume_from_memory(self, live: Callable[[], dict[str, Any]] | None
                            ) -> tuple[resume_mod.Restored | None, str]:
        """The newest snapshot every rank has, when newer than the durable checkpoints."""
        durable = None
        if self.rank == 0:  # the listing is kept: _choose picks from it
            self._scanned = {f: catalog.scan(f) for f in (self.folder, self.mirror) if f}
            steps = [e.step for entries in self._scanned.values() for e in entries
                     if e.step is not None and e.state == "complete"]
            durable = max(steps, default=None)
        restored, reason = peer_resume.resume(self.memory, self.run, durable, live)
        if restored is None:
            return None, reason
        if self.rank == 0:
            if restored.resharded is not None:  # a smaller (or larger) world, from memory
                self._journal("checkpoint_resharded", step=restored.step,
                              path=str(restored.path), **restored.resharded)
            self._journal("checkpoint_resumed",
                          **peer_resume.resumed_fields(restored, reason, durable))
        self.memory.facts["resumed_step"] = restored.step  # the durable facts stay as they are
        self._publish()
        return restored, reason

    def _choose(self, check: Callable[[Path], Any]) -> dict[str, Any]:
        folders = [f for f in (self.folder, self.mirror) if f is not None]
        scanned, self._scanned = self._scanned, {}
        chosen, passed_over = resume_mod.select(folders, check, scanned)
        for i, fallback in enumerate(passed_over):
            nxt = passed_over[i + 1].path if i + 1 < len(passed_over) else (
                chosen.path if chosen else None)
            self._journal("checkpoint_fallback", path=str(fallback.path), reason=fallback.reason,
                          next=str(nxt) if nxt else None)
            log.warning("checkpoint %s not used: %s", fallback.path, fallback.reason)
        if chosen is None:
            if passed_over:
                return {"error": f"no checkpoint verifies ({len(passed_over)} found, newest "
                                 f"{passed_over[0].path.name}: {passed_over[0].reason}); refusing "
                                 "to start over them: move them away or set "
                                 "checkpoint.resume: never", "file": str(self.folder)}
            return {}
        assert chosen.manifest is not None, "a verified checkpoint's manifest was read"
        refused = self._refusal(chosen.path, chosen.manifest)
        if refused is not None:
            self._journal("checkpoint_failed", path=str(chosen.path), error=str(refused),
                          phase="resume")
        return self._decide(chosen.path, chosen.manifest)

    def _refusal(self, path: Path, manifest: dict[str, Any]) -> ConfigError | None:
        """Why this run must not resume the verified checkpoint ``path`` (another config's,
        the other kind), or None."""
        try:
            resume_mod.check_compatible(manifest, path, config_hash=self.config_hash,
                                        sharded=self.expect_sharded)
        except ConfigError as exc:
            return exc
        return None

    def _decide(self, path: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        """What every rank does with the verified checkpoint ``path``: resume it, or stop
        with the error (rank 0 decides; parallel_verify.py hands it to the others)."""
        refused = self._refusal(path, manifest)
        if refused is not None:
            return {"error": refused.problem, "file": refused.file, "told": self._telling}
        return {"path": str(path), "manifest": manifest, "told": self._telling}

    # ------------------------------------------------------------------ in the loop
    def note_metrics(self, **metrics: float) -> None:
        """Validation results recorded in the next checkpoint (``val_loss`` drives keep_best)."""
        self._metrics.update({k: float(v) for k, v in metrics.items()})

    def check_step(self, step: int, loss: torch.Tensor,
                   grad_norm: torch.Tensor | float | None = None, *, data: Any = None) -> bool:
        """Agree job-wide on this step: False if any rank saw a NaN/Inf (the step must be skipped).

        One all_reduce of three numbers (non-finite flag, save and stop requests) per step;
        on a GPU reading its result is one small device-to-host copy.
        """
        if not self.cfg.enabled or self.cfg.nonfinite == "off":
            return True
        flag = nonfinite_flag(loss, grad_norm)
        bad_ranks, save, stop, sources = self._agree(step, flag)
        if not bad_ranks:
            return True
        position = data() if callable(data) else data
        with self._lock:
            self.facts["nonfinite_skipped_total"] += 1
        action = "halted" if self.cfg.nonfinite == "halt" else "skipped"
        if self.rank == 0 or flag.item():
            self._journal("nonfinite_detected", step=step, ranks_affected=int(bad_ranks),
                          this_rank_bad=bool(flag.item()), action=action,
                          data_position=_jsonable(position))
        self._publish()
        if action == "halted":
            raise NonFiniteHalt(f"NaN/Inf loss or gradient at step {step} on {int(bad_ranks)} "
                                "rank(s); halting (checkpoint.nonfinite: halt)")
        return False

    def after_step(self, step: int, state: Callable[[], dict[str, Any]], *,
                   final: bool = False,
                   snapshot_state: Callable[[], dict[str, Any]] | None = None,
                   data: Callable[[], Any] | None = None, snapshot_live: Any = None) -> bool:
        """Save if due (interval, request, stop, end); True when the loop must stop (SIGTERM).

        ``step`` is the number of steps completed; ``state`` is called only when saving
        (durably); ``snapshot_state`` (default ``state``) when taking a memory snapshot;
        ``data`` (default ``snapshot_state()["data"]``) this rank's data position alone,
        kept every step for the dying gasp (memory_snapshots/rank_parts.py);
        ``snapshot_live``: the objects ``snapshot_state`` reads (memory_snapshots/live.py).
        """
        if not self.cfg.enabled:
            return False
        if self._agreed is not None and self._agreed[0] == step - 1:
            _, save, stop, sources = self._agreed
        else:
            _, save, stop, sources = self._agree(step - 1, None)
        self._agreed = None
        interval = interval_due(step, self.cfg.every_steps)
        if (save or stop) and (self.rank == 0 or sources):
            # Rank 0 records the step all ranks agreed on; a rank that got the request
            # itself (a signal to one process) records where it came from.
            self._journal("checkpoint_requested", step=step, sources=sources, stop=bool(stop))
        if stop:
            self._save(step, state(), "stop", force_wait=True)
            self.wait()
            if self._group is not None:
                dist.barrier(group=self._group)  # ranks exit together, after rank 0 wrote
            self.exit_code = EXIT_STOPPED
            return True
        taken = snapshot_state or state
        self.memory.after_step(step, taken, final=final, durable=bool(save or interval),
                               live=snapshot_live)
        if not final:
            self.gasp.after_step(step, taken, data or (lambda: taken().get("data")))
        if final and self.cfg.save_final:
            self._save(step, state(), "final", force_wait=True)
        elif save or interval:
            self._save(step, state(), "request" if save else "interval")
        return False

    # ------------------------------------------------------------------ internals
    def _agree(self, step: int, flag: torch.Tensor | None) -> tuple[float, bool, bool, list[str]]:
        save, stop, sources = self.requests.take()
        if flag is None:
            flags = torch.tensor([0.0, float(save), float(stop)])
        else:
            flags = torch.stack([flag, flag.new_tensor(float(save)), flag.new_tensor(float(stop))])
        if self.distributed and self.world_size > 1:
            group = self._group if flags.device.type == "cpu" else None
            dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=group)
        bad, any_save, any_stop = flags.tolist()
        if any_stop:  # stop is final: keep asking until the boundary that acts on it
            self.requests.stop = True
        agreed = (bad, bool(any_save), bool(any_stop), sources)
        self._agreed = (step, *agreed[1:])
        return agreed

    def _is_sharded(self, state: dict[str, Any]) -> bool:
        """Whether the state holds DTensors, looked at once for the saves and the memory
        snapshots alike. Before any collective or file: every rank refuses the same
        unsaveable state, and sees the same sharded state (saved through DCP)."""
        if not self._state_checked:
            self._sharded = whole_state.check_trees(state)
            self._state_checked = True
        return self._sharded

    def _save(self, step: int, state: dict[str, Any], reason: str, *,
              force_wait: bool = False) -> None:
        self._is_sharded(state)
        started = time.perf_counter()
        phase = self.telemetry.phase("checkpoint") if self.telemetry else contextlib.nullcontext()
        with phase:
            if self._sharded:
                self._save_sharded(step, state, reason, started, force_wait=force_wait)
                return
            shared = {k: v for k, v in state.items() if k != "data"}
            mine: dict[str, Any] = {"rng": rng.capture(), "data": state.get("data")}
            ranks = [mine]
            if self._group is not None:
                # gather_object fills rank 0's list in place, one state per rank.
                gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
                dist.gather_object(mine, gathered, dst=0, group=self._group)
                if gathered is not None:
                    ranks = gathered
            if self.rank != 0:
                return
            waited = 0.0
            if self._writer is not None and self._writer.is_alive():
                if self.cfg.when_busy == "skip" and not force_wait:
                    with self._lock:
                        self.facts["skipped_total"] += 1
                    self._journal("checkpoint_skipped", step=step, reason="a save is in flight",
                                  policy="skip", in_flight_step=self.facts.get("in_flight_step"))
                    self._publish()
                    return
                t0 = time.perf_counter()
                self._writer.join()
                waited = time.perf_counter() - t0
            # Per-rank state is small: a deep copy keeps it safe from the loop while written.
            payload = Payload(step, shared, copy.deepcopy(ranks), self.config_hash, reason,
                              dict(self._metrics))
            with self._lock:
                self.facts.update(in_flight=True, in_flight_step=step)
            if self.cfg.mode == "sync":
                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    # The writer's helpers read device state (the NaN/Inf guard) from other
                    # threads, outside the loop's stream: let the loop's work finish first.
                    torch.cuda.synchronize()
                self._write(payload, started, waited)
                return
            # The writer starts now: it helps with the copy, then writes each tree.
            handoff = Handoff(list(shared), started)
            payload.shared = handoff
            try:
                self._writer = threading.Thread(target=self._write,
                                                args=(payload, started, waited),
                                                name="trainwatch-checkpoint-writer", daemon=True)
                self._writer.start()
            except Exception as exc:  # no thread to be had
                self._writer = None
                self._failed(step, exc, self.folder)
                return
            try:
                self._snapshot.start()
                for key, tree in shared.items():
                    handoff.put(key, self._snapshot.copy(tree, offer=handoff.offer))
                self._snapshot.finish()
                handoff.close()
            except BaseException as exc:  # e.g. no host memory: the writer journals it
                handoff.fail(exc)  # (and never waits for a tree that will not come)
                if not isinstance(exc, Exception):
                    raise

    def _write(self, payload: Payload, started: float, waited: float) -> None:
        """Write, verify, mirror and prune one checkpoint; never raises (failures are journaled).

        ``started`` is the perf_counter the save started at: in sync mode the loop waits
        for all of this; in async mode ``payload.shared`` (a Handoff) says how long.
        """
        mode = self.cfg.mode
        guard = nonfinite_state if self.cfg.nonfinite != "off" else None
        try:
            if isinstance(payload.shared, Handoff):
                payload.shared.help()  # the copy first: the loop waits for it, not for this
            written = write_checkpoint(self.folder, payload, fsync=self.cfg.fsync, check=guard)
            # The digests were taken from the bytes as written; reading them back now would
            # only read the page cache, so this checks the manifest and sizes.  Resume and
            # `trainwatch checkpoint verify` hash every file.
            check = verify(written.path, full=False)
        except CheckRefused as poisoned:
            self._refused(payload, poisoned.found)
            return
        except Exception as exc:  # a failed save must never fail the job
            self._failed(payload.step, exc, self.folder)
            return
        shared = payload.shared
        blocking = (shared.blocking() if isinstance(shared, Handoff)
                    else time.perf_counter() - started)
        self._written(payload, written, check, blocking, waited, mode)

    def _save_sharded(self, step: int, state: dict[str, Any], reason: str, started: float, *,
                      force_wait: bool = False) -> None:
        """Every rank writes its own shards through DCP; rank 0 seals (sharded_save.py).

        Async: the loop copies its shards to host memory (host_stager) and a writer
        thread writes them, its collectives over a gloo group of their own (the loop's
        go on meanwhile). A save waits for the one in flight (``when_busy: skip`` would
        let ranks decide differently, and their collectives would not match)."""
        self.wait()
        shared = {k: v for k, v in state.items() if k != "data"}
        mine = {"rng": rng.capture(), "data": copy.deepcopy(state.get("data"))}
        payload = Payload(step, shared, [mine], self.config_hash, reason, dict(self._metrics))
        with self._lock:
            self.facts.update(in_flight=True, in_flight_step=step)
        if self.cfg.mode == "sync" or force_wait:
            self._write_sharded(payload, started, None)
            return
        if self._writer_group is None and self.distributed:
            self._writer_group = dist.new_group(backend="gloo")  # every rank is at this save
        stager = self._stager if self._stager is not None else host_stager()
        if torch.cuda.is_available():
            self._stager = stager  # its pinned host buffers are kept for the next save
        tmp, error, payload.shared = stage(self.folder, payload, rank=self.rank,
                                           group=self._group, stager=stager)
        blocking = time.perf_counter() - started
        done = None if stager is self._stager else stager.close  # the copy freed after
        try:
            self._writer = threading.Thread(target=self._write_sharded,
                                            args=(payload, started, (tmp, error), blocking, done),
                                            name="trainwatch-checkpoint-writer", daemon=True)
            self._writer.start()
        except Exception as exc:  # no thread: write here (every rank must take part)
            log.warning("trainwatch checkpoint: no writer thread (%s); writing in the loop", exc)
            self._writer = None
            self._write_sharded(payload, started, (tmp, error), blocking, done)

    def _write_sharded(self, payload: Payload, started: float,
                       staged: tuple[Any, str] | None, blocking: float | None = None,
                       done: Callable[[], None] | None = None) -> None:
        """Write and seal one sharded checkpoint (the loop's thread, or the writer's);
        never raises (failures are journaled by rank 0). ``done``: called after it, always
        (releases the host copy)."""
        try:
            self._write_sharded_now(payload, started, staged, blocking)
        finally:
            payload.shared = {}
            if done is not None:
                done()

    def _write_sharded_now(self, payload: Payload, started: float,
                           staged: tuple[Any, str] | None, blocking: float | None) -> None:
        guard = nonfinite_state if self.cfg.nonfinite != "off" else None
        group = self._group if staged is None else self._writer_group
        try:
            written = write_sharded(self.folder, payload, rank=self.rank,
                                    world_size=self.world_size, group=group,
                                    fsync=self.cfg.fsync, check=guard, staged=staged)
            check = verify(written.path, full=False) if written is not None else None
        except CheckRefused as poisoned:
            self._refused(payload, poisoned.found)
            return
        except Exception as exc:  # a failed save must never fail the job
            if self.rank == 0:
                self._failed(payload.step, exc, self.folder)
            else:
                log.warning("trainwatch checkpoint: save of step %s failed: %s", payload.step,
                            exc)
                with self._lock:
                    self.facts.update(in_flight=False)
            return
        if written is None or check is None:  # not rank 0: rank 0 journals the outcome
            with self._lock:
                self.facts.update(in_flight=False)
            return
        loop_blocked = time.perf_counter() - started if blocking is None else blocking
        self._written(payload, written, check, loop_blocked, 0.0,
                      "sync" if staged is None else "async")

    def _refused(self, payload: Payload, found: list[str]) -> None:
        """A loop without the step guard (check_step) trained on a NaN: keep the last good
        checkpoints, the ones a rollback returns to, out of retention's reach."""
        with self._lock:
            self.facts["skipped_total"] += 1
            self.facts["in_flight"] = False
        self._journal("checkpoint_skipped", step=payload.step, policy="nonfinite",
                      reason=f"NaN/Inf in {', '.join(found[:3])}"
                             + (f" and {len(found) - 3} more" if len(found) > 3 else ""))
        self._publish()

    def _written(self, payload: Payload, written: Written, check: Any, blocking: float,
                 waited: float, mode: str) -> None:
        """A written checkpoint: journal it, or fail it if its manifest does not check."""
        if not check.ok:
            self._failed(payload.step, RuntimeError(f"verification after write: {check.reason}"),
                         self.folder)
            return
        self._newest_verified[self.folder] = written.path
        self._journal("checkpoint_saved", step=payload.step, path=str(written.path),
                      bytes=written.bytes, blocking_seconds=round(blocking, 6),
                      write_seconds=round(written.seconds, 6), waited_seconds=round(waited, 6),
                      mode=mode, reason=payload.reason, metrics=payload.metrics)
        with self._lock:
            self.facts.update(step=payload.step, path=str(written.path), time=time.time(),
                              ok=True, bytes=written.bytes, last_error=None, in_flight=False)
            self.facts["saves_total"] += 1
        self._publish()
        self._prune(self.folder)
        if self.mirror is not None:
            self._copy_to_mirror(written, self.mirror)

    def _copy_to_mirror(self, written: Written, mirror: Path) -> None:
        try:
            copy = copy_checkpoint(written.path, mirror, fsync=self.cfg.fsync)
        except Exception as exc:
            self._failed(None, exc, mirror, copy=True)
            return
        self._newest_verified[mirror] = copy.path
        self._journal("checkpoint_saved", step=int(written.path.name.split("-")[1]),
                      path=str(copy.path), bytes=copy.bytes, write_seconds=round(copy.seconds, 6),
                      copy="mirror", copied_from=str(written.path))
        self._prune(mirror)

    def _failed(self, step: int | None, exc: BaseException, folder: Path, *,
                copy: bool = False) -> None:
        errno_ = getattr(exc, "errno", None)
        leftovers = [str(e.path) for e in catalog.scan(folder) if e.state == "incomplete"]
        self._journal("checkpoint_failed", step=step, folder=str(folder), error=str(exc),
                      errno=errno_, copy="mirror" if copy else None,
                      previous=str(self._newest_verified.get(folder) or "") or None,
                      partial_left=leftovers or None)
        log.warning("trainwatch checkpoint: save of step %s failed: %s", step, exc)
        with self._lock:
            self.facts.update(ok=False, last_error=str(exc)[:300], in_flight=False)
            self.facts["failures_total"] += 1
        self._publish()

    def _prune(self, folder: Path) -> None:
        doomed = retention.to_prune(catalog.scan(folder), keep_last=self.cfg.keep_last,
                                    keep_best=self.cfg.keep_best,
                                    newest_verified=self._newest_verified.get(folder))
        for entry, reason in doomed:
            shutil.rmtree(entry.path, ignore_errors=True)
            self._journal("checkpoint_pruned", step=entry.step, path=str(entry.path),
                          reason=reason, removed=not entry.path.exists())

    def _publish(self) -> None:
        if self.telemetry is not None:
            with self._lock:
                facts = dict(self.facts)
            self.telemetry.set_checkpoint(**facts)

    def _journal(self, event: str, **fields: Any) -> None:
        fields = {k: v for k, v in fields.items() if v is not None}
        if self.telemetry is not None:
            self.telemetry.event(event, **fields)
            return
        try:
            self.run.append_event(event, rank_source(self.rank), rank=self.rank, **fields)
        except Exception as exc:  # the journal may sit on the full disk too
            log.warning("trainwatch checkpoint: could not journal %s: %s", event, exc)


def _jsonable(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return repr(value)[:200]
