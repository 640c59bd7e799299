"""Trainer config: YAML + --set overrides, validated up front with file and key named."""

import pytest

from trainwatch.errors import ConfigError
from trainwatch.trainer.config import load_config


def write(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_file_then_overrides_win(tmp_path):
    path = write(tmp_path, "model: {layers: 3, width: 96, heads: 6}\noptim:\n  lr: 1.0e-3\n"
                           "checkpoint:\n")
    cfg = load_config(path, ["optim.lr=2e-3", "train.steps=7", "telemetry.peak_flops=1e12"])
    assert (cfg.model.layers, cfg.model.width, cfg.model.heads) == (3, 96, 6)
    assert cfg.optim.lr == 2e-3  # "2e-3" is a string to YAML 1.1; float fields accept it
    assert cfg.train.steps == 7 and cfg.telemetry.peak_flops == 1e12
    assert cfg.digest() != load_config(path).digest()


# source: which file the message must name ("--set" for overrides, cross-checks name the file).
@pytest.mark.parametrize("text, overrides, key, words, source", [
    ("model: {layerz: 3}\n", [], "model.layerz", "unknown key", "file"),
    ("trian: {steps: 3}\n", [], "trian", "unknown key", "file"),
    ("train: {steps: 2.5}\n", [], "train.steps", "must be int", "file"),
    ("train: {steps: true}\n", [], "train.steps", "must be int", "file"),
    ("optim: {cosine: 'yes'}\n", [], "optim.cosine", "must be bool", "file"),
    ("model: 3\n", [], "model", "must be a mapping", "file"),
    ("checkpoint: {every: 5}\n", [], "checkpoint.every", "unknown key", "file"),
    ("model: {width: 64, heads: 5}\n", [], "model.heads", "divisible", "file"),
    ("", ["optim.lr=fast"], "optim.lr", "must be float", "--set"),
    ("", ["train.nosuch=1"], "train.nosuch", "unknown key", "--set"),
    ("", ["train.steps.x=1"], "train.steps.x", "not a section", "--set"),
    ("", ["train.steps=0"], "train.steps", "at least 1", "file"),
    ("telemetry: {reduction_every: -1}\n", [], "telemetry.reduction_every", "must be >= 0",
     "file"),
    ("", ["telemetry.reduction_every=often"], "telemetry.reduction_every", "must be int", "--set"),
    ("parallel: {mode: zero3}\n", [], "parallel.mode",
     "must be ddp, fsdp or hsdp, got 'zero3'", "file"),
    ("parallel: {mode: FSDP}\n", [], "parallel.mode", "must be ddp, fsdp or hsdp", "file"),
    ("", ["parallel.mode=2"], "parallel.mode", "must be str, got int", "--set"),
    ("", ["parallel.shards=2"], "parallel.shards", "unknown key (known here: mode, shard_size)",
     "--set"),
    ("parallel: {mode: hsdp}\n", [], "parallel.shard_size", "parallel.mode: hsdp needs it",
     "file"),
    ("parallel: {mode: fsdp, shard_size: 2}\n", [], "parallel.shard_size",
     "only for parallel.mode: hsdp (this is fsdp)", "file"),
    ("parallel: {mode: hsdp, shard_size: 0}\n", [], "parallel.shard_size", "at least 1",
     "file"),
])
def test_bad_config_names_file_and_key(tmp_path, text, overrides, key, words, source):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert info.value.key == key and f"key '{key}'" in message and words in message
    assert info.value.file == (str(path) if source == "file" else source)


def test_example_config_lists_every_key_with_its_default(repo):
    import yaml
    from trainwatch.trainer.config import Config

    example = yaml.safe_load((repo / "examples" / "trainer.yaml").read_text())
    defaults = Config().to_dict()
    # The checkpoint section is documented with checkpointing (docs/checkpoints.md).
    example.pop("checkpoint", None)
    defaults.pop("checkpoint")
    assert example == defaults
    assert load_config(repo / "examples" / "trainer.yaml") == Config()


def test_parallel_mode_is_how_ranks_share_the_model_not_what_the_weights_are():
    """A checkpoint records its layout and resume checks it (checkpoint_format/compat.py),
    so parallel.mode stays out of the weights digest: a run's digest is the same in
    either mode, and the same as before the key existed."""
    ddp, fsdp = load_config(None, []), load_config(None, ["parallel.mode=fsdp"])
    assert (ddp.parallel.mode, fsdp.parallel.mode) == ("ddp", "fsdp")
    assert ddp.training_digest() == fsdp.training_digest() == "54075f4d30ce"  # as before
    assert ddp.digest() != fsdp.digest()


def test_an_unquoted_off_is_the_word_off_where_off_is_a_choice(tmp_path):
    """YAML 1.1 reads `off` as false: docs/checkpoints.md writes `nonfinite: off` unquoted,
    and `--set checkpoint.memory_snapshots=off` goes through the same YAML reading."""
    path = write(tmp_path, "checkpoint: {nonfinite: off, memory_snapshots: off}\n")
    cfg = load_config(path, ["checkpoint.peer_copies=off"])
    assert (cfg.checkpoint.nonfinite, cfg.checkpoint.memory_snapshots,
            cfg.checkpoint.peer_copies) == ("off", "off", "off")
    with pytest.raises(ConfigError, match="fsync"):  # a real boolean stays a boolean
        load_config(write(tmp_path, "checkpoint: {fsync: maybe}\n"))


def test_checkpoints_from_a_mapping_read_a_yaml_off_as_off():
    from trainwatch.rank.checkpoint.config import CheckpointConfig
    cfg = CheckpointConfig.from_mapping({"nonfinite": False, "memory_snapshots": False})
    assert (cfg.nonfinite, cfg.memory_snapshots) == ("off", "off")
    with pytest.raises(ConfigError, match="checkpoint.mode"):
        CheckpointConfig.from_mapping({"mode": False})


@pytest.mark.parametrize("key", ["memory_snapshots", "nonfinite"])
def test_off_written_bare_in_yaml_is_the_setting_off(tmp_path, key):
    """`memory_snapshots: off`, as docs/memory-snapshots.md says to turn snapshots off,
    exited 2 with "must be str, got bool False": YAML 1.1 reads a bare off as false."""
    path = tmp_path / "c.yaml"
    path.write_text(f"checkpoint:\n  {key}: off\n")
    assert getattr(load_config(path).checkpoint, key) == "off"
    assert getattr(load_config(None, [f"checkpoint.{key}=off"]).checkpoint, key) == "off"
    with pytest.raises(ConfigError, match="must be one of auto, every_step, off, got 'off'|"
                                          "must be str, got bool True"):
        load_config(None, ["checkpoint.memory_snapshots=on"])
