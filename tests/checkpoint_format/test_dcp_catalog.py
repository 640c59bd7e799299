"""The torch-free checkpoint reader recognizes a directory saved with
torch.distributed.checkpoint (real DCP files from a gloo group) and declared by the job:
a checkpoint of kind ``dcp``, never "manifest.json: missing (the save did not finish)"."""

import subprocess
import sys

from dcp_helpers import declare, save_dcp
from trainwatch.checkpoint_format.catalog import complete, newest_complete, scan
from trainwatch.checkpoint_format.declared import declared_steps, run_checkpoints
from trainwatch.rundir.run_dir import RunDir

SEEN = "DCP checkpoint, 1 shard file, metadata present, declared by the job"


def _declared_run(tmp_path, name="step-00000004", step=4):
    run = RunDir(tmp_path / "run").create()
    path = run.checkpoint_dir / name
    save_dcp(path)
    declare(run.root, path, step)
    return run, path


def test_a_declared_dcp_checkpoint_is_listed_as_one_not_as_an_unfinished_save(tmp_path):
    run, path = _declared_run(tmp_path)
    (entry,) = scan(run.checkpoint_dir, declared_steps(run))
    assert (entry.path, entry.step, entry.state, entry.kind) == (path, 4, "dcp", "dcp")
    assert entry.reason == SEEN and entry.shards == 1 and entry.declared
    assert entry.as_dict()["kind"] == "dcp" and entry.bytes > 0
    # not handed to code that loads trainwatch checkpoints (the reference trainer)
    assert complete(run.checkpoint_dir) == [] and newest_complete([run.checkpoint_dir]) is None
    (undeclared,) = scan(run.checkpoint_dir)
    assert undeclared.state == "dcp" and undeclared.reason.endswith(
        "not declared in this run's journal")


def test_a_dcp_save_without_its_metadata_did_not_finish(tmp_path):
    run, path = _declared_run(tmp_path)
    (path / ".metadata").unlink()  # DCP writes it last, once every rank's shards are there
    (entry,) = run_checkpoints(run)
    assert entry.state == "invalid" and entry.kind == "dcp"
    assert entry.reason == ("DCP checkpoint, 1 shard file, .metadata missing (the save did not "
                            "finish, or it was deleted)")


def test_a_dcp_checkpoint_declared_outside_the_checkpoint_folder_counts(tmp_path):
    run = RunDir(tmp_path / "run").create()
    path = run.root / "own" / "latest"  # any name, anywhere: the journal gives its step
    save_dcp(path)
    declare(run.root, path, 7)
    declare(run.root, path, 9)  # saved over: counts once, with its newest step
    assert scan(run.checkpoint_dir) == []
    (entry,) = run_checkpoints(run)
    assert (entry.path, entry.step, entry.state, entry.declared) == (path, 9, "dcp", True)


def test_reading_a_dcp_checkpoint_never_imports_torch(tmp_path):
    """``.metadata`` is a pickle: the torch-free reader (the controller, diagnose, the
    summary) recognizes a DCP directory by its names alone."""
    run, _ = _declared_run(tmp_path)
    code = ("import sys\nfrom trainwatch.rundir.run_dir import RunDir\n"
            "from trainwatch.checkpoint_format.declared import run_checkpoints\n"
            f"entries = run_checkpoints(RunDir({str(run.root)!r}))\n"
            "print([e.reason for e in entries], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == f"[{SEEN!r}] False"
