"""The CPU peak-memory probe sees a piece of work's peak even after a higher earlier one."""

import torch

from trainwatch.rehearse import memory
from trainwatch.rehearse.memory import PeakMemory

MiB = 1 << 20


def touch(n_bytes: int) -> bytearray:
    block = bytearray(n_bytes)  # glibc serves this with mmap: freed, it leaves the RSS
    block[::4096] = b"\1" * len(block[::4096])
    return block


def test_the_peak_after_the_baseline_is_measured_though_an_earlier_one_was_higher():
    earlier = touch(256 * MiB)
    del earlier
    probe = PeakMemory(torch.device("cpu"))
    work = touch(64 * MiB)
    peak = probe.peak_bytes()
    del work
    assert peak is not None, "the earlier 256 MiB peak hid the 64 MiB one"
    assert 60 * MiB <= peak <= 80 * MiB, peak / MiB


def test_without_a_resettable_high_water_mark_a_hidden_peak_is_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "PROC_SELF", str(tmp_path))  # no clear_refs, no status
    earlier = touch(256 * MiB)
    del earlier
    probe = PeakMemory(torch.device("cpu"))
    work = touch(16 * MiB)
    assert probe.peak_bytes() is None
    del work
