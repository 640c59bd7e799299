"""`trainwatch checkpoint list|verify|digest` of a DCP checkpoint the job declared: listed
as one, verified against its ``.metadata`` (a missing or truncated shard, a missing or
corrupt ``.metadata`` is BAD naming the file), digested through DCP."""

import json

import pytest

from dcp_helpers import declare, save_dcp, shard
from trainwatch.errors import ConfigError
from trainwatch.rank.checkpoint import resume
from trainwatch.rank.checkpoint.digest import state_digest
from trainwatch.rundir.run_dir import RunDir


def cli(*args):
    from click.testing import CliRunner
    from trainwatch.rank.checkpoint.cli import checkpoint
    return CliRunner().invoke(checkpoint, list(args))


@pytest.fixture
def declared(tmp_path):
    run = RunDir(tmp_path / "run").create()
    path = run.checkpoint_dir / "step-00000004"
    state = save_dcp(path)
    declare(run.root, path, 4)
    return run, path, state


def test_list_shows_a_declared_dcp_checkpoint(declared):
    run, path, _ = declared
    listed = cli("list", str(run.root), "--json")
    assert listed.exit_code == 0, listed.output
    (entry,) = json.loads(listed.output)
    assert (entry["kind"], entry["state"], entry["step"], entry["shards"]) == ("dcp", "dcp", 4, 1)
    text = cli("list", str(path)).output
    assert "metadata present, declared by the job" in " ".join(text.split())
    assert "missing" not in text


def test_verify_checks_what_the_metadata_promises(declared):
    run, path, _ = declared
    ok = cli("verify", str(run.root))
    assert ok.exit_code == 0 and ok.output.startswith(f"OK  {path}  (DCP: .metadata parses")
    assert json.loads(cli("verify", str(path), "--json").output)["checkpoints"][0]["kind"] == "dcp"
    data = shard(path)
    size = data.stat().st_size
    with open(data, "r+b") as fh:
        fh.truncate(size - 100)
    bad = cli("verify", str(run.root))
    assert bad.exit_code == 1, bad.output
    assert (f"BAD {path}\n    {data.name}: {size - 100} bytes, .metadata needs at least {size} "
            "(truncated)") in bad.output
    data.unlink()
    bad = cli("verify", str(path))
    assert bad.exit_code == 1 and f"{data.name}: missing (named by .metadata)" in bad.output


@pytest.mark.parametrize("damage", ["garbage", "deleted"])
def test_a_missing_or_corrupt_metadata_is_bad(declared, damage):
    run, path, _ = declared
    if damage == "garbage":
        (path / ".metadata").write_bytes(b"\x80\x04not a pickle at all")
        why = ".metadata: corrupt or not DCP metadata (UnpicklingError"
    else:
        (path / ".metadata").unlink()
        why = ".metadata: missing (the save did not finish, or it was deleted)"
    bad = cli("verify", str(run.root))
    assert bad.exit_code == 1 and why in bad.output, bad.output
    digest = cli("digest", str(path))  # ConfigError: `trainwatch` exits 2 with its message
    assert isinstance(digest.exception, ConfigError) and "does not verify" in str(digest.exception)


def test_digest_loads_the_whole_state_through_dcp(declared):
    run, path, state = declared
    expected = state_digest({"model.w": state["model"]["w"], "model.b": state["model"]["b"]})
    for target in (run.root, path):
        out = cli("digest", str(target))
        assert out.exit_code == 0, out.output
        assert out.output.split() == [expected, str(path)]
    assert json.loads(cli("digest", str(path), "--json").output)["kind"] == "dcp"


def test_the_checkpointer_passes_over_a_dcp_checkpoint_saying_what_it_is(declared):
    """`Checkpoints` and the reference trainer cannot load DCP: they never pick it."""
    run, path, _ = declared
    chosen, passed_over = resume.select([run.checkpoint_dir])
    assert chosen is None
    assert [(f.path, f.reason.split(",")[0]) for f in passed_over] == [(path, "DCP checkpoint")]
