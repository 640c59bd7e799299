"""A config file validated in a child process (``agent/config_child.py``): the same
settings and the same errors as in process, and pydantic never in the caller."""

import datetime
import subprocess
import sys
import textwrap

import pytest

from trainwatch.agent.config import load_config
from trainwatch.agent.config_child import settings_in_child
from trainwatch.errors import ConfigError
from agent_helpers import REPO

GOOD = """\
listen: 127.0.0.1:9555
node: node-7
collectors:
  gpu: {enabled: false}
  network: {peers: ["10.0.0.2:22"]}
stall: {floor_seconds: 3.5, phase_budgets: {eval: 900}}
straggler: {windows: 4.0}
"""


def test_the_child_gives_the_settings_validating_in_process_gives(tmp_path):
    path = tmp_path / "agent.yaml"
    for text in (GOOD, "", "stall:\n"):
        path.write_text(text)
        here = load_config(path, run_dirs=["r"])
        apart = load_config(path, run_dirs=["r"], read=settings_in_child)
        assert vars(apart) == vars(here)
        assert repr(vars(apart)) == repr(vars(here))  # 4 stays int, 3.5 float
    assert apart.stall["floor_seconds"] == load_config(None, run_dirs=["r"]).stall[
        "floor_seconds"]


@pytest.mark.parametrize("text", [
    "collectors:\n  storage:\n    probe_timeout: soon\n",  # a key and its line
    "stall: [1, 2\n",                                        # YAML syntax
    "colectors: {}\n",                                       # unknown key
    "straggler: {ratio: 1.2, clear_ratio: 1.5}\n",           # a model's own check
    "- 1\n",                                                 # not a mapping
])
def test_a_bad_file_is_the_very_error_of_in_process(tmp_path, text):
    path = tmp_path / "agent.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as here:
        load_config(path, run_dirs=["r"])
    with pytest.raises(ConfigError) as apart:
        load_config(path, run_dirs=["r"], read=settings_in_child)
    got, want = apart.value, here.value
    assert (got.problem, got.file, got.key, got.line, str(got)) == \
        (want.problem, want.file, want.key, want.line, str(want))


def test_a_missing_file_names_it(tmp_path):
    with pytest.raises(ConfigError) as err:
        settings_in_child(tmp_path / "none.yaml")
    assert err.value.file == str(tmp_path / "none.yaml") and "not found" in err.value.problem


def test_yaml_values_come_back_as_they_were(tmp_path):
    """A collector's free-form option may hold any YAML value (a date): pickled, not JSON."""
    from trainwatch.agent.config import file_settings

    path = tmp_path / "agent.yaml"
    path.write_text("collectors:\n  network: {peers: [2026-12-06]}\n")
    settings = settings_in_child(path)
    assert settings == file_settings(path)
    assert settings["collectors"]["network"]["peers"] == [datetime.date(2026, 12, 6)]


def test_the_caller_never_imports_pydantic(tmp_path):
    path = tmp_path / "agent.yaml"
    path.write_text(GOOD)
    code = textwrap.dedent(f"""
        import sys
        from trainwatch.agent.config import load_config
        from trainwatch.agent.config_child import settings_in_child
        cfg = load_config({str(path)!r}, run_dirs=["r"], read=settings_in_child)
        assert cfg.stall["floor_seconds"] == 3.5, cfg.stall
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("pydantic", "yaml")
                        or m == "trainwatch.agent.settings")
        assert not loaded, loaded
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
