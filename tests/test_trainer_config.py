"""Trainer config: YAML + --set overrides, validated up front with file and key named."""

import pytest

from trainwatch.errors import ConfigError
from trainwatch.trainer.config import load_config
from trainwatch.trainer.faults import Fault, FaultInjector, parse_faults


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
])
def test_bad_config_names_file_and_key(tmp_path, text, overrides, key, words, source):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert info.value.key == key and f"key '{key}'" in message and words in message
    assert info.value.file == (str(path) if source == "file" else source)


def test_fault_specs_parse_and_reject_nonsense():
    faults = parse_faults("exit:rank=1:step=5:code=3, slow:rank=0:factor=1.5,"
                          "hang:step=2:attempt=any")
    assert faults[0] == Fault("exit", rank=1, step=5, attempt=0, code=3)
    assert faults[1] == Fault("slow", rank=0, attempt=None, factor=1.5)
    assert faults[2].rank is None and faults[2].attempt is None
    for bad in ("explode:step=1", "exit:rank=1", "sleep:step=1", "slow:factor=0.5",
                "exit:step=x", "exit:step=1:colour=red"):
        with pytest.raises(ConfigError) as info:
            parse_faults(bad)
        assert info.value.file == "TRAINWATCH_FAULT"


def test_one_shot_faults_fire_on_first_attempt_only():
    faults = parse_faults("sleep:rank=1:step=2:seconds=0.01")
    fired = []
    first = FaultInjector(faults, rank=1, attempt=0, on_fire=lambda f, s: fired.append(s))
    for step in range(4):
        with first.forward(step):
            pass
    assert fired == [2]
    assert FaultInjector(faults, rank=1, attempt=1).faults == []
    assert FaultInjector(faults, rank=0, attempt=0).faults == []


def test_nan_fault_makes_the_loss_non_finite_once_at_its_step():
    import math

    import torch

    (fault,) = parse_faults("nan:rank=1:step=3")
    assert fault == Fault("nan", rank=1, step=3, attempt=0)
    fired = []
    injector = FaultInjector([fault], rank=1, attempt=0, on_fire=lambda f, s: fired.append(s))
    losses = [injector.loss(step, torch.tensor(2.0)).item() for step in (2, 3, 3, 4)]
    assert losses[0] == 2.0 and math.isnan(losses[1]) and losses[2:] == [2.0, 2.0]
    assert fired == [3]
    with injector.forward(3):  # the forward hook leaves nan alone (it acts on the loss)
        pass
    assert fired == [3]
    always = FaultInjector(parse_faults("nan:step=0:attempt=any"), rank=0, attempt=2)
    assert math.isnan(always.loss(0, torch.tensor(1.0)).item())
    assert FaultInjector([fault], rank=1, attempt=1).faults == []
    with pytest.raises(ConfigError):
        parse_faults("nan:rank=0")  # needs step=N


def test_example_config_lists_every_key_with_its_default(repo):
    import yaml
    from trainwatch.trainer.config import Config

    example = yaml.safe_load((repo / "examples" / "trainer.yaml").read_text())
    assert example == Config().to_dict()
    assert load_config(repo / "examples" / "trainer.yaml") == Config()
