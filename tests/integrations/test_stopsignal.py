"""The framework callbacks' SIGTERM handler tells the same SIGTERM delivered again (Slurm
signals every process of a step and torchrun forwards its copy; a killed supervisor's
PDEATHSIG reaches torchrun once per thread) from a second stop: the first asks for a save
and a stop, a repeat is ignored, a later one kills as if unhandled."""

import signal
import time

from trainwatch.integrations import stopsignal
from trainwatch.rank.checkpoint import requests


def test_a_repeated_sigterm_is_the_same_stop_a_later_one_kills(monkeypatch):
    killed: list[int] = []
    monkeypatch.setattr(stopsignal.os, "kill", lambda pid, sig: killed.append(sig))
    monkeypatch.setattr(stopsignal.signal, "signal", lambda sig, handler: None)
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    told: list[int] = []
    term = stopsignal.StopSignal(told.append)

    term.on_term(signal.SIGTERM, None)
    assert term.asked.is_set() and not killed and told == [signal.SIGTERM]
    now[0] += 0.003  # torchrun forwarding the next copy
    term.on_term(signal.SIGTERM, None)
    assert not killed, "the same stop delivered again killed the rank before it saved"
    assert told == [signal.SIGTERM]
    now[0] += requests.REPEAT_SECONDS
    term.on_term(signal.SIGTERM, None)
    assert killed == [signal.SIGTERM]


def test_install_and_restore_put_back_the_handler_before(monkeypatch):
    def previous(signum, frame):
        pass
    original = signal.signal(signal.SIGTERM, previous)
    try:
        term = stopsignal.StopSignal()
        term.install()
        assert signal.getsignal(signal.SIGTERM) == term.on_term
        term.restore()
        assert signal.getsignal(signal.SIGTERM) is previous
    finally:
        signal.signal(signal.SIGTERM, original)
