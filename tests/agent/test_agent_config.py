"""Agent config validation: every mistake names the file, the key and the problem (exit 2)."""

import subprocess
import sys

import pytest

from trainwatch.agent.config import build_config, load_config
from trainwatch.errors import ConfigError
from agent_helpers import REPO


def test_defaults_cover_every_registered_collector(tmp_path):
    cfg = load_config(None, run_dirs=[str(tmp_path)])
    assert cfg.listen.startswith("127.0.0.1:")  # loopback by default
    assert set(cfg.collectors) == {"ranks", "findings", "gpu", "nccl", "storage", "network",
                                   "versions", "journal", "replicas", "supervisor", "links"}
    assert cfg.collectors["gpu"]["enabled"] is True
    assert cfg.stall["phase_budgets"]["checkpoint"] > cfg.stall["floor_seconds"]


def test_the_defaults_written_without_pydantic_are_the_models_defaults():
    """An agent without a config file runs on ``default_settings`` (pydantic is not
    loaded for it); they must be exactly what the models give an empty file."""
    from trainwatch.agent.config import agent_settings_model, default_settings
    from trainwatch.config.model import validate

    assert default_settings() == validate(agent_settings_model(), {}).model_dump()
    assert vars(build_config({})) == vars(build_config({"stall": {}}))  # validated


@pytest.mark.parametrize("data, key, problem", [
    ({"colectors": {}}, "colectors", "unknown key"),
    ({"collectors": {"gpuu": {}}}, "collectors.gpuu", "unknown collector"),
    ({"collectors": {"gpu": {"interval": "fast"}}}, "collectors.gpu.interval", "number"),
    ({"collectors": {"gpu": {"interval": 0}}}, "collectors.gpu.interval", "> 0"),
    ({"collectors": {"storage": {"probe": "yes"}}}, "collectors.storage.probe", "true or false"),
    ({"collectors": {"network": {"peers": "a:1"}}}, "collectors.network.peers", "list"),
    ({"stall": {"k": -1}}, "stall.k", ">= 0"),
    ({"stall": {"k": 0}}, "stall.k", "> 0"),
    ({"stall": {"phase_budgets": {"eval": "long"}}}, "stall.phase_budgets.eval", "number"),
    ({"straggler": {"ratio": 0.9}}, "straggler.ratio", "> 1"),
    ({"straggler": {"windows": 1.5}}, "straggler.windows", "whole number"),
    ({"listen": "localhost"}, "listen", "HOST:PORT"),
    ({"run_dirs": ["runs/a", ""]}, "run_dirs", "empty path"),  # not the working directory
    ({"discover": " "}, "discover", "empty path"),
])
def test_bad_values_name_file_key_and_problem(data, key, problem):
    with pytest.raises(ConfigError) as err:
        build_config(data, file="agent.yaml")
    assert err.value.key == key and err.value.file == "agent.yaml"
    assert problem in err.value.problem


def test_cli_exits_2_on_bad_config_and_missing_run_dir(tmp_path):
    bad = tmp_path / "agent.yaml"
    bad.write_text("collectors:\n  storage:\n    probe_timeout: soon\n")
    cmd = [sys.executable, "-m", "trainwatch", "agent", "--run-dir", str(tmp_path)]
    out = subprocess.run(cmd + ["--config", str(bad)], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2
    assert str(bad) in out.stderr and "collectors.storage.probe_timeout" in out.stderr
    bad.write_text("stall: [1, 2\n")
    out = subprocess.run(cmd + ["--config", str(bad)], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2 and "invalid YAML" in out.stderr
    out = subprocess.run([sys.executable, "-m", "trainwatch", "agent"], capture_output=True,
                         text=True, cwd=REPO)
    assert out.returncode == 2 and "--run-dir" in out.stderr
    good = tmp_path / "good.yaml"
    good.write_text("collectors:\n  gpu: {enabled: false}\nstall: {floor_seconds: 3}\n")
    out = subprocess.run(cmd + ["--config", str(good), "--check-config"], capture_output=True,
                         text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert '"floor_seconds": 3' in out.stdout


def test_sample_config_in_deploy_is_valid():
    cfg = load_config(REPO / "deploy" / "agent.yaml")
    assert cfg.discover or cfg.run_dirs
