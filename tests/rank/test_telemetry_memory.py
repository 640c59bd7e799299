"""A pending step keeps no CPU tensor alive until the flush (issue #25: +20 MiB a rank).

Each small CPU tensor held between heartbeats pinned 0.1-0.2 MiB of the C heap between a
step's large temporaries; a CPU value is read when recorded instead (nothing to wait
for), with the same line in the metrics log."""

from __future__ import annotations

import gc
import json
import weakref

import psutil
import torch

from trainwatch.rank.telemetry import Telemetry


def test_recorded_cpu_tensors_are_not_held_until_the_flush(tmp_path):
    tel = Telemetry(tmp_path, heartbeat_interval=3600, exchange_every=0).start()
    weight = torch.ones(3, requires_grad=True)
    loss = (weight * 2.0).sum()
    grad_norm = torch.tensor(0.5, dtype=torch.float64)
    held = [weakref.ref(loss), weakref.ref(grad_norm)]
    with tel.step(0) as s:
        s.record(loss=loss, grad_norm=grad_norm, many=torch.ones(2), tokens=8)
    del loss, grad_norm
    gc.collect()
    assert [ref() for ref in held] == [None, None]
    tel.close()
    line = json.loads((tmp_path / "metrics" / "rank-00000.jsonl").read_text().splitlines()[0])
    assert (line["loss"], line["grad_norm"], line["many"], line["tokens"]) == (6.0, 0.5, None, 8)


def test_a_second_of_pending_cpu_steps_costs_no_heap(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tel = Telemetry(tmp_path, heartbeat_interval=3600, exchange_every=0,
                    max_pending=200).start()

    def steps(first: int, n: int) -> None:
        for step in range(first, first + n):
            with tel.step(step) as s:
                x = torch.randn(128, 256)
                loss = torch.nn.functional.mse_loss(model(x), x)
                opt.zero_grad()
                loss.backward()
                opt.step()
                s.record(loss=loss, samples=128)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared machine: no spinning worker threads
    try:
        steps(0, 30)  # the allocator's working set
        before = psutil.Process().memory_info().rss
        steps(30, 150)  # never flushed: all of them pending
        grown = psutil.Process().memory_info().rss - before
    finally:
        torch.set_num_threads(threads)
        tel.close()
    assert grown < 8 * 1024 * 1024, f"{grown / 2**20:.1f} MiB for 150 pending steps"
