"""Config files share one typed style: JSON Schemas are current, errors name file, key, line."""

import json
import subprocess
import sys

import pytest

from trainwatch.agent.config import load_config
from trainwatch.alerts.rules import load_thresholds
from trainwatch.config.schema import SCHEMA_DIR, SCHEMAS, schema_text
from trainwatch.errors import ConfigError
from trainwatch.preflight.settings import load_settings
from agent_helpers import REPO


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_committed_schema_is_current(name):
    committed = (REPO / SCHEMA_DIR / f"{name}.json").read_text()
    assert committed == schema_text(name), f"run: trainwatch config export ({name})"
    assert json.loads(committed)["type"] == "object"


def test_schema_rejects_unknown_keys_like_the_loader():
    schema = json.loads(schema_text("agent"))
    assert schema["additionalProperties"] is False
    assert "collectors" in schema["properties"]


@pytest.mark.parametrize("loader, text, key, line", [
    (lambda p: load_config(p, run_dirs=["/tmp"]), "stall:\n  floor_seconds: 3\n  k: fast\n",
     "stall.k", 3),
    (lambda p: load_config(p, run_dirs=["/tmp"]), "collectors:\n  gpu:\n    enabled: true\n"
     "    intervall: 3\n", "collectors.gpu.intervall", 4),
    (load_settings, "gpu:\n  xid_ignore: [13]\nhost:\n  min_shm_bytes: lots\n",
     "host.min_shm_bytes", 4),
    (load_thresholds, "stall_for: 1m\nloss_spike_factor: big\n", "loss_spike_factor", 2),
])
def test_errors_name_file_key_and_line(tmp_path, loader, text, key, line):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        loader(path)
    assert (err.value.file, err.value.key, err.value.line) == (str(path), key, line)
    assert f"{path}:{line}, key '{key}'" in str(err.value)


def test_cli_prints_a_schema_and_rejects_an_unknown_name():
    done = subprocess.run([sys.executable, "-m", "trainwatch", "config", "schema", "preflight"],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0 and json.loads(done.stdout)["title"].startswith("trainwatch")
    done = subprocess.run([sys.executable, "-m", "trainwatch", "config", "schema", "nope"],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 2


def test_override_files_schemas_require_nothing_and_show_the_defaults():
    preflight = json.loads(schema_text("preflight"))
    assert "required" not in json.dumps(preflight)
    storage = preflight["$defs"]["StorageSettings"]["properties"]
    assert storage["min_free_bytes"]["default"] == load_settings(None)["storage"]["min_free_bytes"]
    thresholds = json.loads(schema_text("thresholds"))
    assert thresholds["properties"]["stall_for"]["default"] == load_thresholds()["stall_for"]
    assert thresholds["additionalProperties"] is False
