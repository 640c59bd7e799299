"""The Hugging Face callback tells the same SIGTERM delivered again (a killed supervisor's
PDEATHSIG reaches torchrun once per thread, and torchrun forwards each one to the ranks
milliseconds apart) from a second stop: the first saves and exits, a repeat is ignored, a
later one kills as if unhandled."""

import signal
import time

import pytest

from trainwatch.trainer.checkpoint import requests


def test_a_repeated_sigterm_is_the_same_stop_a_later_one_kills(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from trainwatch.integrations import transformers as hf

    killed: list[int] = []
    monkeypatch.setattr(hf.os, "kill", lambda pid, sig: killed.append(sig))
    monkeypatch.setattr(hf.signal, "signal", lambda sig, handler: None)
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    callback = hf.TrainwatchCallback(tmp_path / "run")

    callback._on_term(signal.SIGTERM, None)
    assert callback._term.is_set() and not killed
    now[0] += 0.003  # torchrun forwarding the next copy
    callback._on_term(signal.SIGTERM, None)
    assert not killed, "the same stop delivered again killed the rank before it saved"
    now[0] += requests.REPEAT_SECONDS
    callback._on_term(signal.SIGTERM, None)
    assert killed == [signal.SIGTERM]
