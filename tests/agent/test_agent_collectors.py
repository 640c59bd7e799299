"""Collectors against fixture trees, fakes of the GPU only, and real files, mounts and sockets."""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agent_helpers import FIXTURES, _gpu, collector, make_ctx, publish, samples, value, wait_for, write_status
from conftest import tmpfs_mount
from fake_nvml import FakeGpuBackend
from trainwatch.agent.registry import Result
from trainwatch.agent.state import CollectorRecord
from trainwatch.rundir.run_dir import RunDir


# --------------------------------------------------------------------------- ranks
def test_ranks_skips_and_counts_torn_and_alien_status_files(tmp_path):
    run = RunDir(tmp_path / "run").create()
    write_status(run, 0, os.getpid())
    (run.status_dir / "rank-00001.json").write_text('{"format": "trainwatch.status", "vers')
    (run.status_dir / "rank-00002.json").write_text('{"format": "something.else", "version": 1}')
    (run.status_dir / "rank-00003.json").write_text(
        '{"format": "trainwatch.status", "version": 99}')
    ctx = make_ctx([run.root])
    ranks = collector(ctx, "ranks")
    first = ranks.collect()
    second = ranks.collect()  # the same bad files again: not counted twice
    skipped = samples(second, "trainwatch_collector_status_files_skipped_total")
    assert {dict(k)["reason"]: v for k, v in skipped.items() if v} == {
        "not_json": 1, "alien_format": 1, "unsupported_version": 1}
    (run.status_dir / "rank-00001.json").write_text("garbage, new version of the file")
    third = ranks.collect()
    assert value(third, "trainwatch_collector_status_files_skipped_total", run="exp",
                 reason="not_json") == 2
    job = third.data["jobs"][0]
    assert [r["rank"] for r in job["ranks"]] == [0]
    assert {Path(s["path"]).name for s in job["skipped"]} >= {"rank-00002.json"}
    assert value(first, "trainwatch_rank_up", rank=0) == 1
    assert value(first, "trainwatch_process_state", rank=0, state="running") + value(
        first, "trainwatch_process_state", rank=0, state="sleeping") == 1
    assert value(first, "trainwatch_train_loss", rank=0) == 1.5
    assert value(first, "trainwatch_rank_phase", rank=0, phase="forward") == 1
    assert not [x for x in first.every_sample()
                if x.name == "trainwatch_train_last_nonfinite_loss_timestamp_seconds"]


def test_rank_series_are_built_when_a_scrape_reads_them_not_every_collection(tmp_path):
    run = RunDir(tmp_path / "run").create()
    for rank in (0, 1):
        write_status(run, rank, os.getpid())
    ctx = make_ctx([run.root])
    result = collector(ctx, "ranks").collect()
    assert not [s for s in result.samples if s.name == "trainwatch_rank_up"]
    assert len(result.later) == 2  # one producer per rank, nothing built yet
    ctx.store.set(CollectorRecord("ranks", True, 1, 1))
    ctx.store.finish("ranks", result, started=time.time(), duration=0.01)
    stored = list(ctx.store.get("ranks").samples)
    assert stored == list(ctx.store.get("ranks").samples)  # a second read builds the same
    assert sorted(s.labels["rank"] for s in stored if s.name == "trainwatch_rank_up") == ["0", "1"]


def test_another_nodes_rank_is_never_taken_for_ours_in_a_multi_node_job(tmp_path):
    """On a shared run dir, before this node's ranks write, only the other node's status
    is there: its pid means nothing here, so reporting it (as dead) could restart a
    healthy job. A one-node job whose statuses name another host of this machine and boot
    (the trainer's container) is still ours; tests/agent/test_agent_rank_locality.py has
    one of another machine."""
    from trainwatch.node import boot_id
    run = RunDir(tmp_path / "run").create()
    write_status(run, 1, os.getpid(), node="node-b", boot=boot_id())
    ranks = collector(make_ctx([run.root]), "ranks")
    assert [r["rank"] for r in ranks.collect().data["jobs"][0]["ranks"]] == [1]  # one node
    run.write_run_info({"job": "exp", "nnodes": 2, "world_size": 2})
    assert ranks.collect().data["jobs"][0]["ranks"] == []
    run.write_run_info({"job": "exp", "nnodes": 1, "world_size": 2})
    write_status(run, 0, os.getpid(), node="node-c")  # two other nodes named: several
    assert ranks.collect().data["jobs"][0]["ranks"] == []
    write_status(run, 0, os.getpid())  # ours has written
    assert [r["rank"] for r in ranks.collect().data["jobs"][0]["ranks"]] == [0]


def test_ranks_export_when_the_newest_nonfinite_loss_happened(tmp_path):
    run = RunDir(tmp_path / "run").create()
    write_status(run, 0, os.getpid(), last_nonfinite_loss_at=1796208437.5)
    result = collector(make_ctx([run.root]), "ranks").collect()
    assert value(result, "trainwatch_train_last_nonfinite_loss_timestamp_seconds",
                 rank=0) == 1796208437.5


def _facts(**kw):
    """The ``checkpoint`` field the checkpoint library publishes (Checkpointer.facts)."""
    return {"step": None, "path": None, "time": None, "ok": None, "bytes": None,
            "last_error": None, "in_flight": False, "saves_total": 0, "failures_total": 0,
            "skipped_total": 0, "nonfinite_skipped_total": 0, **kw}


def test_ranks_export_checkpoint_age_and_failures_from_the_status_files(tmp_path):
    now = time.time()
    saved = RunDir(tmp_path / "saved").create()  # rank 1 saw a newer save than rank 0
    write_status(saved, 0, os.getpid(), job="saved", checkpoint=_facts(
        step=100, time=now - 300, ok=True, saves_total=2, failures_total=1))
    # Its last save failed: ``time`` still names its newest verified one.
    write_status(saved, 1, os.getpid(), job="saved", checkpoint=_facts(
        step=200, time=now - 100, ok=False, saves_total=3, failures_total=2))
    fresh = RunDir(tmp_path / "fresh").create()  # checkpointing on, nothing saved yet
    write_status(fresh, 0, os.getpid(), job="fresh", started_at=now - 50,
                 checkpoint=_facts())
    done = RunDir(tmp_path / "done").create()  # finished: no age (nothing is at risk)
    write_status(done, 0, os.getpid(), job="done", state="finished",
                 checkpoint=_facts(step=10, time=now - 9000, ok=True, failures_total=4))
    plain = RunDir(tmp_path / "plain").create()  # no checkpoint library: no series
    write_status(plain, 0, os.getpid(), job="plain")
    other = RunDir(tmp_path / "other").create()  # a node without rank 0 (the save facts)
    write_status(other, 3, os.getpid(), job="other", checkpoint=_facts())
    result = collector(make_ctx([saved.root, fresh.root, done.root, plain.root, other.root]),
                       "ranks").collect()
    age = samples(result, "trainwatch_checkpoint_age_seconds")
    failures = samples(result, "trainwatch_checkpoint_failures_total")
    node = ("node", "node-a")
    assert 100 <= age[(node, ("run", "saved"))] < 160
    assert 50 <= age[(node, ("run", "fresh"))] < 110
    assert set(age) == {(node, ("run", "saved")), (node, ("run", "fresh"))}
    assert failures == {(node, ("run", "saved")): 2, (node, ("run", "fresh")): 0,
                        (node, ("run", "done")): 4, (node, ("run", "other")): 0}


def test_ranks_export_checkpoint_saves_and_nonfinite_skips_from_the_status_files(tmp_path):
    run = RunDir(tmp_path / "run").create()  # rank 0 holds the save facts; both run the guard
    write_status(run, 0, os.getpid(), checkpoint=_facts(saves_total=5, nonfinite_skipped_total=2))
    write_status(run, 1, os.getpid(), checkpoint=_facts(nonfinite_skipped_total=2))
    plain = RunDir(tmp_path / "plain").create()  # no checkpoint library: no series
    write_status(plain, 0, os.getpid(), job="plain")
    result = collector(make_ctx([run.root, plain.root]), "ranks").collect()
    node = ("node", "node-a")
    assert samples(result, "trainwatch_checkpoint_saves_total") == {(node, ("run", "exp")): 5}
    assert samples(result, "trainwatch_train_nonfinite_skipped_steps_total") == {
        (node, ("run", "exp")): 2}


def test_ranks_reports_gone_and_zombie_processes(tmp_path):
    run = RunDir(tmp_path / "run").create()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    write_status(run, 0, child.pid)  # exited and reaped: gone
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_for(lambda: Path(f"/proc/{zombie.pid}/stat").read_text().split(") ")[1].startswith("Z"),
             10, interval=0.05, what="the exited child to be a zombie (not reaped yet)")
    write_status(run, 1, zombie.pid)
    try:
        result = collector(make_ctx([run.root]), "ranks").collect()
    finally:
        zombie.wait()
    assert value(result, "trainwatch_process_state", rank=0, state="gone") == 1
    assert value(result, "trainwatch_process_state", rank=1, state="zombie") == 1
    assert value(result, "trainwatch_rank_up", rank=1) == 0


def test_ranks_look_at_an_on_time_ranks_process_every_few_seconds_and_a_late_ones_at_once(
        tmp_path):
    """psutil costs per rank: an on-time rank's process facts are reused for
    ``process_every`` seconds, but a rank whose heartbeat is late is looked at in the very
    next run (a SIGSTOPped rank shows ``stopped`` long before the hour is up)."""
    run = RunDir(tmp_path / "run").create()
    rank = subprocess.Popen(["sleep", "120"])
    write_status(run, 0, rank.pid)
    ranks = collector(make_ctx([run.root], collectors={"ranks": {"process_every": 3600}}),
                      "ranks")
    def kernel_state() -> str:
        return open(f"/proc/{rank.pid}/stat").read().split(") ")[1][:1]
    try:
        while kernel_state() != "S":  # sleep(1) has started sleeping
            time.sleep(0.01)
        assert value(ranks.collect(), "trainwatch_process_state", state="sleeping") == 1
        os.kill(rank.pid, signal.SIGSTOP)
        while kernel_state() != "T":
            time.sleep(0.01)
        deadline = time.time() + 30
        while time.time() < deadline:
            result = ranks.collect()
            age = value(result, "trainwatch_rank_heartbeat_age_seconds")
            if value(result, "trainwatch_process_state", state="stopped") == 1:
                break
            assert value(result, "trainwatch_process_state", state="sleeping") == 1
            assert age <= 2.0  # on time: the facts of the first look, not a new one
            time.sleep(0.2)
        else:
            raise AssertionError("a late rank's process was not looked at again")
        assert age > 2.0 and value(result, "trainwatch_rank_up") == 1
    finally:
        rank.kill()
        rank.wait()


# --------------------------------------------------------------------------- network
def test_network_reads_fixture_sysfs_tree():
    ctx = make_ctx(sys_root=str(FIXTURES / "sys"), proc_root=str(FIXTURES / "proc"))
    net = collector(ctx, "network")
    result = net.collect()
    assert value(result, "trainwatch_network_receive_bytes_total", device="eth0") == 123456789
    assert value(result, "trainwatch_network_receive_drops_total", device="eth0") == 7
    assert value(result, "trainwatch_network_carrier_changes_total", device="eth0") == 3
    assert value(result, "trainwatch_network_up", device="ib0") == 0
    assert not samples(result, "trainwatch_network_carrier_changes_total").get(
        (("device", "ib0"), ("node", "node-a")))  # missing file: not invented
    assert all(s.labels.get("device") != "lo" for s in result.samples)
    ib = dict(device="mlx5_0", port="1")
    assert value(result, "trainwatch_network_ib_receive_bytes_total", **ib) == 4000  # words x4
    assert value(result, "trainwatch_network_ib_transmit_bytes_total", **ib) == 10000
    assert value(result, "trainwatch_network_ib_rate_bytes_per_second", **ib) == 25e9
    assert value(result, "trainwatch_network_ib_port_active", **ib) == 1
    assert value(result, "trainwatch_network_ib_errors_total", **ib, counter="link_downed") == 2
    with pytest.raises(KeyError):  # "N/A" counters are skipped
        value(result, "trainwatch_network_ib_errors_total", **ib,
              counter="local_link_integrity_errors")
    down = dict(device="mlx5_1", port="1")
    assert value(result, "trainwatch_network_ib_port_active", **down) == 0
    assert value(result, "trainwatch_network_ib_port_info", **down, link_layer="Ethernet",
                 state="DOWN", phys_state="Disabled") == 1
    with pytest.raises(KeyError):
        value(result, "trainwatch_network_ib_receive_bytes_total", **down)
    assert result.data["errors_growing"] == []


def test_network_flags_growing_errors_and_probes_peers(tmp_path):
    import shutil
    root = tmp_path / "sys"
    shutil.copytree(FIXTURES / "sys", root)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connection refused
    ok_peer = f"127.0.0.1:{listener.getsockname()[1]}"
    bad_peer = f"127.0.0.1:{closed.getsockname()[1]}"
    try:
        ctx = make_ctx(sys_root=str(root), collectors={"network": {"peers": [ok_peer, bad_peer]}})
        net = collector(ctx, "network")
        net.collect()
        (root / "class/infiniband/mlx5_0/ports/1/counters/symbol_error").write_text("5\n")
        result = net.collect()
    finally:
        listener.close()
        closed.close()
    assert result.data["errors_growing"] == ["mlx5_0/1"]
    assert value(result, "trainwatch_network_peer_up", peer=ok_peer) == 1
    assert value(result, "trainwatch_network_peer_connect_seconds", peer=ok_peer) >= 0
    assert value(result, "trainwatch_network_peer_up", peer=bad_peer) == 0


# --------------------------------------------------------------------------- gpu

def test_gpu_maps_processes_to_ranks_and_windows_xids(tmp_path):
    run = RunDir(tmp_path / "run").create()
    write_status(run, 0, os.getpid())
    ctx = make_ctx([run.root], collectors={"gpu": {"xid_window_seconds": 0.5}})
    publish(ctx, "ranks", collector(ctx, "ranks").collect())
    fake = FakeGpuBackend([_gpu(0, pids=[os.getpid(), 999999]),
                           _gpu(1, events={"hw_thermal": True})])
    ctx.gpu_backend = lambda: fake
    gpu = collector(ctx, "gpu")
    fake.pending_xids = [(1, 79), (1, 79)]
    result = gpu.collect()
    assert value(result, "trainwatch_gpu_process_memory_bytes", rank=0, gpu=0) == 1 << 30
    assert len(samples(result, "trainwatch_gpu_process_memory_bytes")) == 1  # 999999: no rank
    assert value(result, "trainwatch_gpu_clock_event_active", gpu=1, reason="hw_thermal") == 1
    assert value(result, "trainwatch_gpu_nvlink_errors_total", gpu=0, link=0, type="replay") == 2
    assert value(result, "trainwatch_gpu_xid_events_recent", gpu=1, xid=79) == 2
    assert value(result, "trainwatch_gpu_xid_events_total", gpu=1, xid=79) == 2
    assert value(result, "trainwatch_gpu_sm_clock_hertz", gpu=0) == 1.98e9
    time.sleep(0.6)
    later = gpu.collect()  # window passed: the recent count returns to 0, the total stays
    assert value(later, "trainwatch_gpu_xid_events_recent", gpu=1, xid=79) == 0
    assert value(later, "trainwatch_gpu_xid_events_total", gpu=1, xid=79) == 2
    assert result.data["gpus"][0]["processes"][0]["rank"] == 0
    assert result.data["driver"] == "550.54.15"


def test_gpu_absent_without_nvml_exports_no_numbers():
    ctx = make_ctx()
    ctx.gpu_backend = lambda: FakeGpuBackend(unavailable="NVML Shared Library Not Found")
    result = collector(ctx, "gpu").collect()
    assert result.state == "absent" and "NVML" in result.reason and result.samples == []
    real = collector(make_ctx(), "gpu").collect()  # the real NVML path on this machine
    if real.state == "absent":  # no driver here: must say so and export nothing
        assert real.reason and real.samples == []


def test_gpu_straggler_cause_comes_from_clock_events(tmp_path):
    from trainwatch.agent.collectors.findings import FindingsCollector
    ctx = make_ctx()
    publish(ctx, "gpu", Result(data={"gpus": [{"index": 0, "pids": [42], "clock_events": {
        "hw_thermal": True, "gpu_idle": False}}]}))
    findings = FindingsCollector(ctx, ctx.config.collector("findings"))
    timing = {"local": {1: 1.3}, "data_wait": {1: 0.0}}
    cause, evidence = findings._cause({"timing": timing}, {"rank": 1, "pid": 42})
    assert cause == "gpu_thermal" and "hw_thermal" in evidence[0]
    cause, _ = findings._cause({"timing": {"local": {1: 1.3}, "data_wait": {1: 0.9}}},
                               {"rank": 1, "pid": 7})
    assert cause == "data_wait"
    cause, _ = findings._cause({"timing": timing},
                               {"rank": 1, "pid": 7, "process": {"cpu_contention_ratio": 0.6}})
    assert cause == "cpu_contention"
    publish(ctx, "network", Result(data={"errors_growing": ["eth0"]}))
    assert findings._cause({"timing": timing}, {"rank": 1, "pid": 7})[0] == "network_errors"
    publish(ctx, "network", Result(data={"errors_growing": []}))
    assert findings._cause({"timing": timing}, {"rank": 1, "pid": 7})[0] == "unknown"


# --------------------------------------------------------------------------- storage
@pytest.fixture
def tmpfs(tmp_path):
    """A real 1 MiB tmpfs (root only), unmounted afterwards."""
    with tmpfs_mount(tmp_path / "tmpfs", "1m") as mnt:
        yield mnt


def test_storage_on_a_filling_then_full_tmpfs(tmpfs):
    ctx = make_ctx([tmpfs], collectors={"storage": {"probe_bytes": 65536,
                                                    "probe_interval": 0}})
    storage = collector(ctx, "storage")
    lab = dict(role="run", mountpoint=str(tmpfs))
    first = storage.collect()
    assert value(first, "trainwatch_storage_probe_success", **lab) == 1
    assert 0 < value(first, "trainwatch_storage_free_bytes", **lab) <= 1 << 20
    assert math.isinf(value(first, "trainwatch_storage_time_to_full_seconds", **lab))
    for i in range(3):  # filling up: a finite time to full
        (tmpfs / f"fill{i}").write_bytes(b"x" * 200_000)
        time.sleep(0.05)
        filling = storage.collect()
    assert value(filling, "trainwatch_storage_time_to_full_seconds", **lab) < 60
    with open(tmpfs / "rest", "wb", buffering=0) as fh:  # now fill it completely
        try:
            while True:
                fh.write(b"x" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    full = storage.collect()
    assert value(full, "trainwatch_storage_free_bytes", **lab) == 0
    assert value(full, "trainwatch_storage_probe_success", **lab) == 0
    entry = next(e for e in full.data if e["role"] == "run")
    assert "No space left" in entry["probe"]["error"]
    assert entry["mountpoint"] == str(tmpfs)


def test_storage_reads_free_space_every_collection_and_probes_every_probe_interval(tmpfs):
    """Free space (cheap) on every collection; the write probe's result is kept between
    probes, its series still exported each time."""
    ctx = make_ctx([tmpfs], collectors={"storage": {"probe_interval": 3600}})
    storage = collector(ctx, "storage")
    lab = dict(role="run", mountpoint=str(tmpfs))
    first = storage.collect()
    (tmpfs / "fill").write_bytes(b"x" * 300_000)
    second = storage.collect()
    assert value(second, "trainwatch_storage_free_bytes", **lab) < \
        value(first, "trainwatch_storage_free_bytes", **lab) - 250_000
    assert value(second, "trainwatch_storage_probe_success", **lab) == 1
    assert value(second, "trainwatch_storage_probe_duration_seconds", **lab) == \
        value(first, "trainwatch_storage_probe_duration_seconds", **lab)  # not probed again


def test_storage_probe_that_hangs_becomes_an_error_not_a_hung_agent(tmp_path):
    """A FIFO where the probe file goes blocks open() in the kernel, like a dead mount."""
    run = RunDir(tmp_path / "run").create()
    ctx = make_ctx([run.root], collectors={"storage": {"probe_timeout": 0.5,
                                                        "probe_interval": 0}})
    fifo = run.root / f".trainwatch-probe-{ctx.node}-{os.getpid()}"
    os.mkfifo(fifo)
    storage = collector(ctx, "storage")
    try:
        started = time.monotonic()
        result = storage.collect()
        again = storage.collect()  # the hung probe is not started a second time
        elapsed = time.monotonic() - started
    finally:
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # release the blocked writer
        time.sleep(0.2)
        os.close(fd)
    assert elapsed < 5
    run_entry = next(e for e in result.data if e["role"] == "run")
    assert "hung" in run_entry["probe"]["error"]
    assert value(result, "trainwatch_storage_probe_success", role="run") == 0
    assert value(result, "trainwatch_storage_free_bytes", role="run") > 0  # statvfs still fine
    assert "still hung" in next(e for e in again.data if e["role"] == "run")["probe"]["error"]


def test_storage_probe_where_the_agent_may_not_write_is_skipped_not_failed(tmp_path,
                                                                           monkeypatch):
    """The agent reads a job's 0750 run directory through its group and may not write
    there: a skipped probe, said and counted, never StorageProbeSlow (a real unprivileged
    agent: tests/deploy/test_deploy_shipped_e2e.py)."""
    from trainwatch.agent.collectors import storage as storage_module

    def denied(path, size, node):
        raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(storage_module, "write_probe", denied)
    run = RunDir(tmp_path / "run").create()
    result = collector(make_ctx([run.root]), "storage").collect()
    with pytest.raises(KeyError):
        value(result, "trainwatch_storage_probe_success", role="run")
    assert value(result, "trainwatch_storage_probe_skipped", role="run") == 1
    assert value(result, "trainwatch_storage_free_bytes", role="run") > 0
    entry = next(e for e in result.data if e["role"] == "run")
    assert "may not write here" in entry["probe"]["skipped"] and not entry["probe"]["error"]


def test_storage_parses_diskstats_and_mounts_from_fixture_proc():
    from trainwatch.host.storage import mount_of, parse_diskstats, parse_mounts
    mounts = parse_mounts((FIXTURES / "proc/self/mounts").read_text())
    assert mount_of("/data set/tokens", mounts)[1] == "/data set"
    assert mount_of("/home/x", mounts)[1] == "/"
    stats = parse_diskstats((FIXTURES / "proc/diskstats").read_text())
    assert stats["nvme0n1"] == {"read_bytes": 100000 * 512, "written_bytes": 200000 * 512,
                                "io_seconds": 4.0}


# --------------------------------------------------------------------------- nccl
class FakeRasServer:
    """A RAS endpoint speaking NCCL's client protocol over real TCP on 127.0.0.1."""

    def __init__(self, doc: dict):
        self.doc = doc
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self._answer(conn)

    def _answer(self, conn):
        with conn, conn.makefile("rwb") as f:
            for line in f:
                cmd = line.decode().strip()
                if cmd.startswith("CLIENT PROTOCOL"):
                    f.write(b"SERVER PROTOCOL 2\n")
                elif cmd.startswith(("TIMEOUT", "SET FORMAT")):
                    f.write(b"OK\n")
                elif cmd == "STATUS":
                    f.write(json.dumps(self.doc).encode())
                    f.flush()
                    return
                f.flush()

    def close(self):
        self.sock.close()


RAS_DOC = {"nccl_version": "2.27.3", "communicators_count": 1, "communicators": [
    {"hash": "0x1", "size": 4, "ranks_count": 3, "missing_ranks_count": 1,
     "ranks": [{"rank": r, "status": {"async_error": 1 if r == 2 else 0, "abort_flag": False}}
               for r in range(3)],
     "missing_ranks": [{"rank": 3, "status": {"unresponsive": True, "considered_dead": False}}]}]}


def test_nccl_ras_env_consistency_and_debug_log(tmp_path):
    run = RunDir(tmp_path / "run").create()
    server = FakeRasServer(RAS_DOC)
    log = tmp_path / "nccl.log"
    log.write_text("host:1:1 [0] NCCL INFO Bootstrap\nhost:1:1 [0] misc/socket.cc:50 NCCL WARN "
                   "Net : Connection closed by remote peer\n")
    env = dict(os.environ)
    ranks = []
    try:
        for rank, algo in ((0, "Ring"), (1, "Tree")):  # NCCL_ALGO differs across ranks
            ranks.append(subprocess.Popen(
                [sys.executable, "-c", "import time; time.sleep(30)"],
                env={**env, "NCCL_ALGO": algo, "NCCL_RAS_ADDR": server.address,
                     "NCCL_DEBUG_FILE": str(log), "NCCL_SOCKET_IFNAME": "eth0",
                     "NCCL_IB_SECRET_TOKEN": "s3cret"}))
            write_status(run, rank, ranks[-1].pid, backend="nccl", device=f"cuda:{rank}",
                         started_at=time.time() + 5)
        # Until a child has exec'd, /proc shows the environment it was forked with (ours).
        wait_for(lambda: all(f"NCCL_ALGO={algo}".encode() in
                             Path(f"/proc/{proc.pid}/environ").read_bytes()
                             for proc, algo in zip(ranks, ("Ring", "Tree"))),
                 10, what="the ranks' environments")
        ctx = make_ctx([run.root])
        publish(ctx, "ranks", collector(ctx, "ranks").collect())
        nccl = collector(ctx, "nccl")
        result = nccl.collect()
        with open(log, "a") as fh:
            fh.write("host:1:1 [0] NCCL WARN another\npartial line NCCL WARN")
        later = nccl.collect()
    finally:
        server.close()
        for proc in ranks:
            proc.kill()
            proc.wait()
    lab = dict(run="exp")
    assert value(result, "trainwatch_nccl_ras_up", **lab) == 1
    assert value(result, "trainwatch_nccl_ras_communicators", **lab) == 1
    assert value(result, "trainwatch_nccl_ras_ranks_missing", **lab) == 1
    assert value(result, "trainwatch_nccl_ras_errors", **lab) == 1
    assert value(result, "trainwatch_nccl_env_consistent", **lab) == 0
    assert value(result, "trainwatch_nccl_env_mismatches", **lab) == 1
    assert result.data["jobs"]["exp"]["env_mismatches"] == ["NCCL_ALGO"]
    assert "s3cret" not in json.dumps(result.data)  # env values never leave the agent
    assert value(result, "trainwatch_nccl_log_warnings_total", **lab) == 1
    assert value(later, "trainwatch_nccl_log_warnings_total", **lab) == 2  # partial line waits
    assert result.data["nccl_version"] == "2.27.3"


def test_nccl_absent_for_gloo_jobs(tmp_path):
    run = RunDir(tmp_path / "run").create()
    write_status(run, 0, os.getpid())
    ctx = make_ctx([run.root])
    publish(ctx, "ranks", collector(ctx, "ranks").collect())
    result = collector(ctx, "nccl").collect()
    assert result.state == "ok"
    entry = result.data["jobs"]["exp"]
    assert entry["backend"] == "gloo" and entry["ras"]["state"] == "absent"
    assert entry["progress"] == {"0": 3}
    assert not [s for s in result.samples if s.name.startswith("trainwatch_nccl_ras")]


def test_versions_info_has_every_label():
    result = collector(make_ctx(), "versions").collect()
    (sample,) = result.samples
    assert sample.name == "trainwatch_versions_info"
    assert set(sample.labels) == {"node", "driver", "cuda", "torch", "nccl", "python",
                                  "trainwatch"}
    assert sample.labels["python"] and sample.labels["trainwatch"]
