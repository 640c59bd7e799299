"""A misspelt setting of a framework callback is a ConfigError naming it and what the
callback takes, when the callback is made; it used to surface only inside ``fit`` as
``TypeError: Telemetry.__init__() got an unexpected keyword argument 'every_step'``."""

import pytest

from trainwatch.errors import ConfigError


@pytest.mark.parametrize("framework", ["lightning", "transformers"])
def test_a_misspelt_setting_names_the_callback_key_and_the_known_ones(tmp_path, framework):
    pytest.importorskip(framework)
    module = __import__(f"trainwatch.integrations.{framework}", fromlist=["TrainwatchCallback"])
    with pytest.raises(ConfigError) as raised:
        module.TrainwatchCallback(tmp_path / "run", replica_evry=5)
    text = str(raised.value)
    assert "key 'TrainwatchCallback.replica_evry'" in text
    assert "replica_every" in text and "heartbeat_interval" in text
    module.TrainwatchCallback(tmp_path / "run", heartbeat_interval=0.5)  # a real one is taken
