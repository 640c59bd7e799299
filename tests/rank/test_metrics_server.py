"""A rank can serve its own Prometheus metrics (contract names, loopback, promtool-clean)."""

import shutil
import subprocess
import urllib.request

import torch

from trainwatch.contract.metrics import METRICS
from trainwatch.rank.metrics_server import MetricsServer
from trainwatch.rank.telemetry import Telemetry


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def test_rank_serves_contract_metrics_from_its_telemetry(tmp_path):
    tel = Telemetry(tmp_path, rank=3, local_rank=1, world_size=4, job="exp",
                    heartbeat_interval=3600, exchange_every=0).start()
    for step in range(3):
        with tel.step(step) as s:
            with tel.phase("forward"):
                pass
            s.record(loss=torch.tensor(2.5 - step), grad_norm=torch.tensor(0.5), lr=1e-3,
                     tokens=512)
    tel._flush()  # what the heartbeat thread does every interval
    tel.log(2, val_loss=1.25)
    server = MetricsServer(tel, 0)
    try:
        text = scrape(server.port)
    finally:
        server.close()
        tel.close()
    series = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    labels = 'local_rank="1",node="{}",rank="3",run="exp"'.format(tel.state["node"])
    assert series[f"trainwatch_train_loss{{{labels}}}"] == 0.5
    assert series[f"trainwatch_train_validation_loss{{{labels}}}"] == 1.25
    assert series[f"trainwatch_rank_steps_total{{{labels}}}"] == 3
    assert series[f"trainwatch_rank_step{{{labels}}}"] == 2
    phase = [v for k, v in series.items() if k.startswith("trainwatch_rank_phase_time_seconds{")]
    assert len(phase) == 1 and phase[0] >= 0 and 'phase="forward"' in text
    assert not any(name.startswith("trainwatch_train_mfu_ratio") for name in series)  # unknown
    for name in series:
        base = name.split("{")[0]
        assert base in METRICS or base.removesuffix("_total") + "_total" in METRICS, base
    if shutil.which("promtool"):
        check = subprocess.run(["promtool", "check", "metrics"], input=text, text=True,
                               capture_output=True)
        assert check.returncode == 0, check.stdout + check.stderr


def test_a_busy_port_is_counted_not_raised(tmp_path):
    tel = Telemetry(tmp_path, heartbeat_interval=3600, exchange_every=0).start()
    first = MetricsServer(tel, 0)
    try:
        second = MetricsServer(tel, first.port)
        assert second.port is None
        assert tel.snapshot()["counters"]["telemetry_errors_total"] == 1
        second.close()
    finally:
        first.close()
        tel.close()
