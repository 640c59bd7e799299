"""The run directory's layout: every file and folder a run leaves, named once.

Writers and readers in every component build paths from here (through
``trainwatch.rundir.run_dir.RunDir``, which adds the reading and writing), so a name is
changed in one place. The formats of the files are in docs/run-directory.md;
``FORMAT_VERSION`` is their version.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1

# Document formats (the "format" field of each JSON document).
RUN_FORMAT = "trainwatch.run"
LOCK_FORMAT = "trainwatch.lock"
STATUS_FORMAT = "trainwatch.status"
DUMP_FORMAT = "trainwatch.dump"
SUSPECT_FORMAT = "trainwatch.suspect"  # a node suspected of silent data corruption

# Top level.
RUN_FILE = "run.json"
JOURNAL_FILE = "journal.jsonl"
# The journal event `trainwatch close` writes: a person ended a run whose job is gone (a
# node rebooted, the job was abandoned). Readers treat the run as stopped until a new start.
CLOSED_EVENT = "run_closed"
SUPERVISOR_LOCK_FILE = "supervisor.lock"  # flock'ed by the run's one supervisor; who holds it
SUPERVISOR_BEAT_FILE = "supervisor.beat"  # its heartbeat, overwritten in place (rundir/supervisor_beat.py)
# A multi-node job: one supervisor per node, each with its lock and beat named after its node.
NODE_SUPERVISORS_DIR = "supervisors"      # <node>.lock, <node>.beat
NODE_LOCK_SUFFIX = ".lock"
NODE_BEAT_SUFFIX = ".beat"
STATUS_DIR = "status"
METRICS_DIR = "metrics"
CHECKPOINTS_DIR = "checkpoints"   # the default checkpoint folder (checkpoint.dir moves it)
DIAGNOSTICS_DIR = "diagnostics"
CONTROL_DIR = "control"
ALERTS_DIR = "alerts"
LOGS_DIR = "logs"
TMP_DIR = "tmp"
DRILL_DIR = "drill"
REHEARSAL_DIR = "rehearsal"       # only in a rehearsal's run: what each rank measured
SUSPECTS_DIR = "suspects"         # <node>.json: nodes a replica rollback suspects (preflight)

# control/: touching a file asks every rank (or the action runner) for something.
CONTROL_CHECKPOINT = "checkpoint"        # save a checkpoint at the next step boundary
CONTROL_DUMP = "dump"                    # write stacks and the flight recorder now
CONTROL_HOLD_ACTIONS = "hold-actions"    # automatic actions are held while it exists
# Before a stall restart kills the ranks, the supervisor asks the survivors for their step
# (a dying gasp: rank/memory_snapshots/gasp_request.py, control/gasp_request.py); each
# rank answers in control/gasp-answers/rank-NNNNN.json.
CONTROL_GASP = "gasp"
GASP_ANSWERS_DIR = "gasp-answers"
GASP_FORMAT = "trainwatch.gasp"
SKIP_STEPS_FILE = "skip-steps.json"      # steps a rollback asked to drop
# control/repairs/: a multi-node job's repairs (control/repairs.py): the leader's numbered
# requests, every node's proposals to it, and which node applied which request.
CONTROL_REPAIRS_DIR = "repairs"
REPAIR_REQUEST_PREFIX = "request-"       # request-00001.json: written once, by the leader
REPAIR_PROPOSAL_PREFIX = "proposal-"     # proposal-<node>-<ns>.json: read and removed by it
REPAIR_APPLIED_PREFIX = "applied-"       # applied-00001-<node>.json: that node acted on it
REPAIR_FORMAT = "trainwatch.repair"

# alerts/: the alert state a run keeps.
SILENCES_FILE = "silences.json"
ACTIONS_LEDGER_FILE = "actions.json"

# logs/
TORCHRUN_LOG = "torchrun.log"
TORCHRUN_LOG_DIR = "torchrun"            # torchrun's own per-rank log folders
JOB_LOG = "job.log"
# The line the supervisor writes into JOB_LOG before each attempt's output, so readers
# (diagnose) can tell the newest attempt's errors from those of attempts it recovered from.
JOB_LOG_ATTEMPT_PREFIX = "=== trainwatch: attempt "
JOB_LOG_ATTEMPT_LINE = JOB_LOG_ATTEMPT_PREFIX + "{attempt} started at {time} ({reason}) ===\n"
# ... and after an attempt it stopped on purpose: torchrun answers the SIGTERM with a
# SignalException traceback, which is the stop, not a crash (no "Error:" here: diagnose
# looks for the first error line).
JOB_LOG_STOPPED_LINE = ("=== trainwatch: stopped attempt {attempt} at {time} ({reason}); "
                        "torchrun's SignalException traceback above, if any, is this stop, "
                        "not a crash ===\n")
AGENT_LOG = "agent.log"
REHEARSAL_LOG = "rehearsal.log"              # the rehearsal's ranks (or the user's command)
REHEARSAL_PROBE_LOG = "rehearsal-probe.log"  # its probe ranks, for a user's command
REHEARSAL_AGENT_LOG = "rehearsal-agent.log"
DRILL_RUN_LOG = "run.log"                    # in DRILL_DIR: the drilled `trainwatch run`'s output
DRILL_SECOND_LOG = "second.log"              # in DRILL_DIR: a second supervisor's (refused)
# In a checkpoint folder: a rehearsal's own saves and probe files; hidden, never a step-*
# directory a run could resume from, and removed when the rehearsal ends.
REHEARSAL_SCRATCH_PREFIX = ".rehearsal-"

# run.json: where the run's checkpoints live (primary folder first): relative to the run
# directory when inside it, so a copied or moved run directory names its own; else absolute.
CHECKPOINT_DIRS_KEY = "checkpoint_dirs"

# The run's two config digests, named so that no output mixes them up (docs/run-directory.md):
# CONFIG_DIGEST_KEY hashes the whole resolved config; WEIGHTS_CONFIG_DIGEST_KEY only the
# sections that decide the weights, which a checkpoint's manifest records and a resume must
# match. LEGACY_WEIGHTS_CONFIG_KEY is that value's name in manifests written before.
CONFIG_DIGEST_KEY = "config_digest"
WEIGHTS_CONFIG_DIGEST_KEY = "weights_config_digest"
LEGACY_WEIGHTS_CONFIG_KEY = "config_hash"


# Per-rank files: status/rank-00000.json and rank-00000.beat, metrics/rank-00000.jsonl,
# diagnostics/dump-rank-00000.json, a stall's diagnostics/stall-<time>/py-spy-rank-00000.txt,
# a checkpoint's rank-00000.pt.
RANK_PREFIX = "rank-"
DUMP_PREFIX = "dump-"
PY_SPY_PREFIX = "py-spy-"
BEAT_SUFFIX = ".beat"
# A rank's name as the journal's ``source`` of its events: rank0, rank1, ...
RANK_SOURCE_PREFIX = "rank"
STATUS_FILE_GLOB = f"{RANK_PREFIX}*.json"
METRICS_FILE_GLOB = f"{RANK_PREFIX}*.jsonl"
DUMP_FILE_GLOB = f"{DUMP_PREFIX}{RANK_PREFIX}*.json"


def rank_file_name(rank: int, suffix: str) -> str:
    return f"{RANK_PREFIX}{rank:05d}{suffix}"


def py_spy_file_name(rank: int) -> str:
    return PY_SPY_PREFIX + rank_file_name(rank, ".txt")


def rank_source(rank: int) -> str:
    return f"{RANK_SOURCE_PREFIX}{rank}"


def rank_of_source(source: str) -> int | None:
    """The rank a journal source names (``rank3``: 3); None for another writer."""
    digits = source[len(RANK_SOURCE_PREFIX):] if source.startswith(RANK_SOURCE_PREFIX) else ""
    return int(digits) if digits.isdigit() else None


def rank_of_file(path: Path) -> int | None:
    """The rank a per-rank file belongs to, from its name; None for another file."""
    _, _, number = path.name.split(".", 1)[0].rpartition(RANK_PREFIX)
    return int(number) if number.isdigit() else None


def file_safe(name: str) -> str:
    """A node's name as part of a file name: letters, digits, ``.``, ``_`` and ``-`` kept,
    anything else (``/``, spaces) as ``_``; never empty, never a dot file."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:200]
    return safe if safe and not safe.startswith(".") else f"_{safe}"


class RunLayout:
    """The paths of one run directory; no I/O (``RunDir`` reads and writes them)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    @property
    def run_file(self) -> Path:
        return self.root / RUN_FILE

    @property
    def journal_file(self) -> Path:
        return self.root / JOURNAL_FILE

    @property
    def supervisor_lock_file(self) -> Path:
        return self.root / SUPERVISOR_LOCK_FILE

    @property
    def supervisor_beat_file(self) -> Path:
        return self.root / SUPERVISOR_BEAT_FILE

    def node_supervisor_lock_file(self, node: str) -> Path:
        """A multi-node job's lock of ``node``'s supervisor (one per node)."""
        return self.root / NODE_SUPERVISORS_DIR / (file_safe(node) + NODE_LOCK_SUFFIX)

    def node_supervisor_beat_file(self, node: str) -> Path:
        return self.root / NODE_SUPERVISORS_DIR / (file_safe(node) + NODE_BEAT_SUFFIX)

    @property
    def repairs_dir(self) -> Path:
        return self.control_dir / CONTROL_REPAIRS_DIR

    @property
    def status_dir(self) -> Path:
        return self.root / STATUS_DIR

    @property
    def metrics_dir(self) -> Path:
        return self.root / METRICS_DIR

    @property
    def checkpoint_dir(self) -> Path:
        """The default checkpoint folder; ``recorded_checkpoint_folders`` says where a run's are."""
        return self.root / CHECKPOINTS_DIR

    @property
    def diagnostics_dir(self) -> Path:
        return self.root / DIAGNOSTICS_DIR

    @property
    def control_dir(self) -> Path:
        return self.root / CONTROL_DIR

    @property
    def alerts_dir(self) -> Path:
        return self.root / ALERTS_DIR

    @property
    def logs_dir(self) -> Path:
        return self.root / LOGS_DIR

    @property
    def tmp_dir(self) -> Path:
        return self.root / TMP_DIR

    @property
    def drill_dir(self) -> Path:
        return self.root / DRILL_DIR

    @property
    def rehearsal_dir(self) -> Path:
        return self.root / REHEARSAL_DIR

    @property
    def suspects_dir(self) -> Path:
        return self.root / SUSPECTS_DIR

    @property
    def drill_log(self) -> Path:
        return self.drill_dir / DRILL_RUN_LOG

    @property
    def drill_second_log(self) -> Path:
        return self.drill_dir / DRILL_SECOND_LOG

    def status_file(self, rank: int) -> Path:
        return self.status_dir / rank_file_name(rank, ".json")

    def metrics_file(self, rank: int) -> Path:
        return self.metrics_dir / rank_file_name(rank, ".jsonl")

    def beat_file(self, rank: int) -> Path:
        return self.status_dir / rank_file_name(rank, BEAT_SUFFIX)

    def dump_file(self, rank: int) -> Path:
        return self.diagnostics_dir / f"{DUMP_PREFIX}{rank_file_name(rank, '.json')}"

    def control_file(self, name: str) -> Path:
        return self.control_dir / name

    @property
    def skip_steps_file(self) -> Path:
        return self.control_dir / SKIP_STEPS_FILE

    @property
    def hold_actions_file(self) -> Path:
        return self.control_dir / CONTROL_HOLD_ACTIONS

    @property
    def silences_file(self) -> Path:
        return self.alerts_dir / SILENCES_FILE

    @property
    def actions_ledger_file(self) -> Path:
        return self.alerts_dir / ACTIONS_LEDGER_FILE

    def resolve(self, path: str | Path) -> Path:
        """A path from a run's config: absolute as given, relative to the run directory."""
        path = Path(path)
        return path if path.is_absolute() else self.root / path

    def recordable(self, path: str | Path) -> str:
        """How run.json names a path: relative when it lies in the run directory, so a
        copy of the directory resolves to the copy's files and never to the original's."""
        resolved = Path(path).resolve()
        try:
            return resolved.relative_to(self.root.resolve()).as_posix() or "."
        except ValueError:
            return str(resolved)

    def configured_checkpoint_folders(self, folder: str | None,
                                      mirror: str | None = None) -> list[Path]:
        """The checkpoint folders ``checkpoint.dir`` and ``checkpoint.mirror_dir`` name
        (the default folder when ``dir`` is unset), primary first."""
        folders = [self.resolve(folder) if folder else self.checkpoint_dir]
        if mirror:
            folders.append(self.resolve(mirror))
        return folders

    def recorded_checkpoint_folders(self, run_info: dict[str, Any] | None) -> list[Path]:
        """Where this run's checkpoints live, as its ``run.json`` records them.

        The checkpoint folders may be anywhere (another disk); readers must look where the
        run put them, not only in ``RUN_DIR/checkpoints``. A run.json written before the
        record existed still names them in its trainer config.
        """
        info = run_info if isinstance(run_info, dict) else {}
        recorded = info.get(CHECKPOINT_DIRS_KEY)
        if isinstance(recorded, list) and recorded and all(
                isinstance(p, str) and p for p in recorded):
            # Absolute as the launcher wrote them before, so paths compare equal.
            return [self.resolve(p).resolve() for p in recorded]
        section = (info.get("config") or {}).get("checkpoint") if isinstance(
            info.get("config"), dict) else None
        if isinstance(section, dict):
            folder, mirror = section.get("dir"), section.get("mirror_dir")
            return self.configured_checkpoint_folders(
                folder if isinstance(folder, str) else None,
                mirror if isinstance(mirror, str) else None)
        return [self.checkpoint_dir]
