"""`trainwatch preflight`: fixture /sys trees, the fake NVML (no GPU on this machine),
and real directories, tmpfs mounts, FIFOs, sockets, processes and rlimits."""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import psutil
import pytest
import yaml

from agent_helpers import wait_for
from conftest import tmpfs_mount
from fake_nvml import FakeGpuBackend
from trainwatch.host.nvml import GpuSnapshot
from trainwatch.host.timeouts import Deadline
from trainwatch.preflight import host, network, software
from trainwatch.preflight.model import STATUSES, Request
from trainwatch.preflight.runner import run_checks
from trainwatch.preflight.settings import load_settings

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "preflight.md"
GIB = 1 << 30


def settings(**sections) -> dict:
    """Defaults with some keys changed: settings(storage={"min_free_bytes": 0})."""
    out = load_settings(None)
    for name, values in sections.items():
        if isinstance(values, dict):
            out[name].update(values)
        else:
            out[name] = values
    return out


def checks_of(groups, cfg=None, backend=None, environ=None, **request) -> dict:
    found = run_checks(Request(groups=tuple(groups), **request), cfg or settings(),
                       gpu_backend=backend or (lambda: FakeGpuBackend(unavailable="no NVML")),
                       environ=environ if environ is not None else {})
    ids = [c.id for c in found]
    assert len(ids) == len(set(ids)), ids
    return {c.id: c for c in found if c.group in groups}  # not <other group>.all


def cli(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainwatch", "preflight", *args],
                          capture_output=True, text=True, timeout=timeout, **kw)


def write_config(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


# --------------------------------------------------------------------------- gpu (fake NVML)
def gpu(index, *, used=512 << 20, processes=(), **kw) -> GpuSnapshot:
    events = {"gpu_idle": True, "sw_power_cap": False, "hw_slowdown": False,
              "sw_thermal": False, "hw_thermal": False, "hw_power_brake": False}
    events.update(kw.pop("events", {}))
    fields = dict(name="Fake H100", memory_used=used, memory_total=80 << 30, temperature=35.0,
                  power_watts=70.0, power_limit_watts=700.0, sm_clock_hz=345e6,
                  sm_clock_max_hz=1.98e9, clock_events=events,
                  ecc={"corrected": 0, "uncorrected": 0},
                  retired_pages={"single_bit": 0, "double_bit": 0}, retired_pending=False,
                  remapped_rows={"correctable": 0, "uncorrectable": 0}, remap_pending=False,
                  remap_failed=False, processes=list(processes))
    fields.update(kw)
    return GpuSnapshot(index=index, uuid=f"GPU-{index:04d}", **fields)


def gpu_checks(snaps, cfg=None, xids=()):
    fake = FakeGpuBackend(snaps)
    fake.pending_xids = list(xids)
    found = checks_of(["gpu"], cfg, backend=lambda: fake)
    assert fake.closed == 1  # NVML is shut down after the checks
    return found


def test_gpu_healthy_node_passes_every_gpu_check():
    c = gpu_checks([gpu(0), gpu(1)], settings(gpu={"expect_count": 2, "xid_watch_seconds": 0.3}))
    assert {k: v.status for k, v in c.items()} == {
        "gpu.count": "ok", "gpu.ecc": "ok", "gpu.xid": "ok", "gpu.thermal": "ok",
        "gpu.memory": "ok"}
    assert c["gpu.count"].evidence["driver"] == "550.54.15"
    assert c["gpu.count"].evidence["count"] == 2


def test_gpu_count_mismatch_fails():
    c = gpu_checks([gpu(0), gpu(1)], settings(gpu={"expect_count": 8}))
    assert c["gpu.count"].status == "fail"
    assert "2 GPU(s) visible, expected 8" in c["gpu.count"].message


@pytest.mark.parametrize("fault, words", [
    ({"ecc": {"corrected": 12, "uncorrected": 2}}, "2 uncorrectable ECC"),
    ({"retired_pending": True}, "page retirement pending"),
    ({"remap_pending": True}, "row remapping pending"),
    ({"remap_failed": True}, "row remapping failed"),
])
def test_gpu_ecc_error_fails_with_the_runbook(fault, words):
    c = gpu_checks([gpu(0), gpu(1, **fault)])
    ecc = c["gpu.ecc"]
    assert ecc.status == "fail" and "GPU 1" in ecc.message and words in ecc.message
    assert ecc.runbook == "GPUUncorrectableECC"
    assert c["gpu.thermal"].status == "ok"  # one fault fails one check


def test_gpu_without_ecc_reporting_is_absent_not_ok():
    c = gpu_checks([gpu(0, ecc=None, retired_pages=None, retired_pending=None,
                        remapped_rows=None, remap_pending=None, remap_failed=None)])
    assert c["gpu.ecc"].status == "absent"


def test_gpu_leftover_process_holding_memory_fails_naming_it():
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                               "old_train.py"])
    try:
        c = gpu_checks([gpu(0), gpu(1, used=31 << 30, processes=[(holder.pid, 30 << 30)])])
    finally:
        holder.kill()
        holder.wait()
    mem = c["gpu.memory"]
    assert mem.status == "fail"
    assert f"GPU 1: 31.0 of 80.0 GiB in use by pid {holder.pid}" in mem.message
    assert "old_train.py" in mem.message
    assert mem.evidence["gpus"]["0"]["processes"] == []


def test_gpu_process_under_the_memory_threshold_warns():
    c = gpu_checks([gpu(0, used=1 << 30, processes=[(999999999, 1 << 29)])])
    assert c["gpu.memory"].status == "warn" and "pid 999999999" in c["gpu.memory"].message


def test_gpu_xid_in_the_watch_window_fails_unless_ignored():
    cfg = settings(gpu={"xid_watch_seconds": 0.2})
    c = gpu_checks([gpu(0), gpu(1)], cfg, xids=[(1, 79)])
    assert c["gpu.xid"].status == "fail" and "GPU 1 XID 79" in c["gpu.xid"].message
    cfg["gpu"]["xid_ignore"] = [79]
    assert gpu_checks([gpu(0)], cfg, xids=[(0, 79)])["gpu.xid"].status == "ok"
    assert gpu_checks([gpu(0)])["gpu.xid"].status == "skipped"  # no window asked for


def test_gpu_thermal_and_power_brakes():
    hot = gpu_checks([gpu(0, events={"hw_thermal": True})])["gpu.thermal"]
    assert hot.status == "fail" and "hw_thermal" in hot.message
    assert hot.runbook == "GPUThermalThrottling"
    capped = gpu_checks([gpu(0, events={"sw_power_cap": True})])["gpu.thermal"]
    assert capped.status == "warn" and capped.runbook == "GPUPowerThrottling"
    warm = gpu_checks([gpu(0, temperature=82.0)])["gpu.thermal"]
    assert warm.status == "warn" and "82 °C" in warm.message
    assert gpu_checks([gpu(0, temperature=90.0)])["gpu.thermal"].status == "fail"


def test_gpu_absent_without_nvml_and_fails_only_when_gpus_were_expected():
    c = checks_of(["gpu"], backend=lambda: FakeGpuBackend(unavailable="NVML Shared Library "
                                                                      "Not Found"))
    assert {v.status for v in c.values()} == {"absent"}
    assert all("NVML Shared Library Not Found" in v.message for v in c.values())
    c = checks_of(["gpu"], settings(gpu={"expect_count": 8}),
                  backend=lambda: FakeGpuBackend(unavailable="no driver"))
    assert c["gpu.count"].status == "fail" and "expected 8" in c["gpu.count"].message


def test_gpu_real_nvml_on_this_machine_reports_absence_honestly():
    from trainwatch.host.nvml import NvmlBackend
    c = checks_of(["gpu"], backend=NvmlBackend)
    if c["gpu.count"].status == "absent":  # no GPU here: a reason, no numbers
        assert c["gpu.count"].evidence["reason"]
        assert all(set(v.evidence) == {"reason"} for k, v in c.items() if k != "gpu.count")


# --------------------------------------------------------------------------- sdc
def _suspect(folder: Path, node: str) -> Path:
    from trainwatch.host.suspects import write_suspect
    return write_suspect(folder, node, {
        "ranks": [1], "run": "exp1", "run_dir": "/runs/exp1", "time": 1_800_000_000.0,
        "alert": "TrainingReplicaDivergence",
        "evidence": {"first_odd_step": 24, "last_agreeing_step": 19, "suspects": [1],
                     "majority": True, "digests": 2, "clean_checkpoint_step": 20}})


def test_sdc_suspect_record_fails_its_node_until_removed(tmp_path):
    """A replica rollback's record in RUN_DIR/suspects/ fails the node it names (the real
    CLI, the node from TRAINWATCH_NODE), not another one; removing the file clears it."""
    run = tmp_path / "exp1"
    record = _suspect(run / "suspects", "gpu-node-7")

    def preflight(node):
        done = cli("--run-dir", str(run), "--only", "sdc", "--json",
                   env={**os.environ, "TRAINWATCH_NODE": node})
        return done.returncode, {c["id"]: c for c in json.loads(done.stdout)["checks"]}

    code, checks = preflight("gpu-node-7")
    check = checks["sdc.suspect"]
    assert code == 1 and check["status"] == "fail", check
    assert "node gpu-node-7 is suspected of silent data corruption" in check["message"]
    assert "rank(s) [1] of run exp1" in check["message"] and "from step 24" in check["message"]
    assert f"rm {record}" in check["message"]
    assert check["runbook"] == "TrainingReplicaDivergence"
    assert check["evidence"]["records"][0]["evidence"]["clean_checkpoint_step"] == 20
    code, checks = preflight("gpu-node-8")
    assert code == 0 and checks["sdc.suspect"]["status"] == "ok"
    record.unlink()
    code, checks = preflight("gpu-node-7")
    assert code == 0 and checks["sdc.suspect"]["status"] == "ok"


def test_sdc_suspect_dirs_from_the_config_and_unreadable_records(tmp_path):
    shared = tmp_path / "shared"
    _suspect(shared, "n/1 odd")  # the file name is made safe; the record's node matches
    assert (shared / "n_1_odd.json").is_file()
    cfg = settings(sdc={"suspect_dirs": [str(shared)]})
    with_env = {"TRAINWATCH_NODE": "n/1 odd"}
    old = os.environ.copy()
    try:
        os.environ.update(with_env)
        assert checks_of(["sdc"], cfg)["sdc.suspect"].status == "fail"
        (shared / "n_1_odd.json").unlink()
        (shared / "torn.json").write_text('{"format": "trainwatch.sus')
        c = checks_of(["sdc"], cfg)["sdc.suspect"]
        assert c.status == "warn" and "torn.json" in c.message
        assert checks_of(["sdc"])["sdc.suspect"].status == "skipped"  # nowhere to look
        assert checks_of(["sdc"], settings(sdc={"suspect_dirs": [str(tmp_path / "none")]})
                         )["sdc.suspect"].status == "ok"  # no folder: nothing marked
    finally:
        os.environ.clear()
        os.environ.update(old)
    bad = write_config(tmp_path / "pf.yaml", {"sdc": {"suspect_dirs": "/not/a/list"}})
    done = cli("--config", str(bad), "--only", "sdc")
    assert done.returncode == 2 and "sdc.suspect_dirs" in done.stderr, done.stderr


# --------------------------------------------------------------------------- storage
def small(**kw):
    return settings(storage={"min_free_bytes": 0, "min_free_inodes": 1, **kw})


def test_storage_healthy_directory(tmp_path):
    c = checks_of(["storage"], small(), run_dir=tmp_path)
    assert [c[f"storage.run.{k}"].status for k in ("writable", "space", "inodes")] == ["ok"] * 3
    assert c["storage.run.space"].evidence["free_bytes"] > 0
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def test_storage_missing_directory_fails_and_skips_the_rest(tmp_path):
    c = checks_of(["storage"], small(), checkpoint_dir=tmp_path / "nope")
    assert c["storage.checkpoint.writable"].status == "fail"
    assert "does not exist" in c["storage.checkpoint.writable"].message
    assert c["storage.checkpoint.space"].status == "skipped"


def test_storage_nothing_asked_is_skipped():
    assert checks_of(["storage"])["storage.dirs"].status == "skipped"


def test_storage_read_only_mount_fails(tmp_path):
    with tmpfs_mount(tmp_path / "ro", "1m") as mount:
        (mount / "dataset.bin").write_bytes(b"x" * 1000)
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        c = checks_of(["storage"], small(), run_dir=mount, data_dir=mount)
    assert c["storage.run.writable"].status == "fail"
    assert "read-only filesystem" in c["storage.run.writable"].message
    assert c["storage.run.writable"].evidence["fstype"] == "tmpfs"
    # a data set on a read-only mount is normal: readable is what the data dir needs
    assert c["storage.data.readable"].status == "ok"
    assert "read-only mount" in c["storage.data.readable"].message


def test_storage_real_tmpfs_filled_up_fails(tmp_path):
    with tmpfs_mount(tmp_path / "disk", "2m") as mount:
        cfg = small(min_free_bytes=256 << 10)
        before = checks_of(["storage"], cfg, checkpoint_dir=mount)
        # room for 2 checkpoints of 1.5 MiB does not fit in 2 MiB
        room = checks_of(["storage"], cfg, checkpoint_dir=mount, checkpoint_bytes=1536 << 10)
        with open(mount / "filler", "wb") as fh:
            try:
                while True:
                    fh.write(b"\0" * 65536)
                    fh.flush()
            except OSError:
                pass
        full = checks_of(["storage"], cfg, checkpoint_dir=mount)
    assert before["storage.checkpoint.writable"].status == "ok"
    assert before["storage.checkpoint.space"].status == "ok"
    assert room["storage.checkpoint.space"].status == "fail"
    assert "room for 2 checkpoint(s) of 1.5 MiB" in room["storage.checkpoint.space"].message
    assert full["storage.checkpoint.space"].status == "fail"
    assert full["storage.checkpoint.space"].runbook == "StorageFull"
    assert full["storage.checkpoint.writable"].status == "fail"
    assert "No space left on device" in full["storage.checkpoint.writable"].message


def test_storage_inodes_run_out_on_a_real_tmpfs(tmp_path):
    with tmpfs_mount(tmp_path / "few", "1m,nr_inodes=40") as mount:  # size and inode cap
        for i in range(60):
            try:
                (mount / f"f{i}").touch()
            except OSError:
                break
        c = checks_of(["storage"], small(min_free_inodes=5), run_dir=mount)
    assert c["storage.run.inodes"].status == "fail"
    assert "free inodes" in c["storage.run.inodes"].message


def test_storage_hung_probe_is_a_fail_not_a_hang(tmp_path):
    """A FIFO where the probe file goes blocks its open() for real, like a hung mount;
    the whole CLI must still answer within the probe timeout (the child process ends,
    taking the stuck thread with it)."""
    config = write_config(tmp_path / "pf.yaml", {"storage": {"probe_timeout_seconds": 1,
                                                             "min_free_bytes": 0}})
    script = (
        "import os, socket, sys\n"
        f"os.mkfifo(os.path.join({str(tmp_path)!r}, "
        "f'.trainwatch-probe-{socket.gethostname()}-{os.getpid()}'))\n"
        "from trainwatch.cli import main\n"
        f"sys.argv = ['trainwatch', 'preflight', '--only', 'storage', '--json', '--run-dir', "
        f"{str(tmp_path)!r}, '--config', {str(config)!r}]\n"
        "main()\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert time.monotonic() - started < 30
    assert done.returncode == 1, done.stderr
    c = {x["id"]: x for x in json.loads(done.stdout)["checks"]}
    assert c["storage.run.writable"]["status"] == "fail"
    assert "no answer within 1 s" in c["storage.run.writable"]["message"]
    assert c["storage.run.writable"]["runbook"] == "StorageProbeSlow"


def test_storage_as_a_non_root_user():
    """Preflight runs as the job's user: a directory it cannot write fails with the
    reason, its own directory passes.  Forked so the child can drop to nobody."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to another user")
    base = Path(tempfile.mkdtemp(prefix="tw-preflight-"))
    try:
        base.chmod(0o755)
        (base / "roots").mkdir(mode=0o755)
        (base / "mine").mkdir()
        os.chown(base / "mine", 65534, 65534)
        cfg = small()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: become nobody, check, report through the pipe
            try:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                found = checks_of(["storage", "host"], cfg, run_dir=base / "roots",
                                  checkpoint_dir=base / "mine")
                payload = {k: [v.status, v.message] for k, v in found.items()}
            except BaseException as exc:  # reported to the parent
                payload = {"error": repr(exc)}
            os.write(write, json.dumps(payload).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as fh:
            result = json.loads(fh.read())
        os.waitpid(pid, 0)
    finally:
        shutil.rmtree(base)
    assert "error" not in result, result
    assert result["storage.run.writable"][0] == "fail"
    assert "Permission denied" in result["storage.run.writable"][1]
    assert result["storage.checkpoint.writable"][0] == "ok"
    assert all(result[k][0] in STATUSES and k.split(".")[0] in ("storage", "host")
               for k in result)
    assert "host.error" not in result


# --------------------------------------------------------------------------- host
def test_host_shm_too_small_and_filled(tmp_path):
    with tmpfs_mount(tmp_path / "shm", "4m") as shm:
        cfg = settings(host={"shm_path": str(shm), "min_shm_bytes": 1 << 20})
        fine = host.check_shm(cfg["host"], Deadline())
        (shm / "torch_1234_leaked").write_bytes(b"\0" * (3 << 20) + b"\0" * (600 << 10))
        filled = host.check_shm(cfg["host"], Deadline())
        cfg["host"]["min_shm_bytes"] = 64 << 20
        small_shm = host.check_shm(cfg["host"], Deadline())
    assert fine.status == "ok"
    assert filled.status == "fail" and "free of 4.0 MiB" in filled.message
    assert filled.evidence["largest_entries"][0].startswith("torch_1234_leaked 3.6 MiB")
    assert small_shm.status == "fail" and "need 64.0 MiB" in small_shm.message


def test_host_missing_shm_fails(tmp_path):
    c = host.check_shm(settings(host={"shm_path": str(tmp_path / "none")})["host"], Deadline())
    assert c.status == "fail" and "No such file" in c.message


def _limits(nofile: tuple[int, int], memlock: tuple[int, int]):
    def apply():
        resource.setrlimit(resource.RLIMIT_NOFILE, nofile)
        resource.setrlimit(resource.RLIMIT_MEMLOCK, memlock)
    return apply


def _cli_host(preexec, *args):
    done = cli("--only", "host", "--json", "--sys-root", str(FIXTURES / "sys"), *args,
               preexec_fn=preexec)
    assert done.returncode in (0, 1), done.stderr
    return {c["id"]: c for c in json.loads(done.stdout)["checks"]}


def test_host_limits_read_from_the_real_process():
    """The fixture /sys has InfiniBand ports, so locked memory must be unlimited."""
    low = _cli_host(_limits((1024, 1024), (64 << 10, 64 << 10)))
    assert low["host.nofile"]["status"] == "fail" and "is 1024" in low["host.nofile"]["message"]
    assert low["host.memlock"]["status"] == "fail"
    assert "mlx5_0" in low["host.memlock"]["message"]
    mid = _cli_host(_limits((8192, 8192), (64 << 10, 64 << 10)), "--sys-root",
                    str(FIXTURES / "nothing"))
    assert mid["host.nofile"]["status"] == "warn"
    assert mid["host.memlock"]["status"] == "ok"  # no RDMA device: the limit does not matter
    # soft limits raised to the hard ones (always allowed; raising a hard one is not here)
    nofile, memlock = (resource.getrlimit(r)[1] for r in (resource.RLIMIT_NOFILE,
                                                          resource.RLIMIT_MEMLOCK))
    high = _cli_host(_limits((nofile, nofile), (memlock, memlock)))
    unlimited = resource.RLIM_INFINITY
    assert high["host.nofile"]["status"] == ("ok" if nofile == unlimited or nofile >= 65536
                                             else "warn")
    assert high["host.memlock"]["status"] == ("ok" if memlock == unlimited else "fail")


def test_host_memory_threshold():
    cfg = settings(host={"fail_available_memory_bytes": 1 << 50})["host"]
    assert host.check_memory(cfg).status == "fail"
    normal = host.check_memory(settings()["host"])
    assert normal.status in ("ok", "warn") and normal.evidence["total_bytes"] > 0


def test_host_leftover_zombie_and_live_trainers():
    """A real zombie named like a torch main thread and a real sleeping `torchrun`."""
    # prctl(PR_SET_NAME): the name torch gives its main thread, then exit unreaped
    zombie_code = "import ctypes; ctypes.CDLL(None).prctl(15, b'pt_main_thread', 0, 0, 0)"
    zombie = subprocess.Popen([sys.executable, "-c", zombie_code])
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                             "torchrun", "--nproc-per-node=8", "train.py"])
    try:
        wait_for(lambda: Path(f"/proc/{zombie.pid}/stat").read_text().split(") ")[1][0] == "Z",
                 20, interval=0.05, what="the exited child to be a zombie")
        check = host.check_leftovers(settings()["host"])
    finally:
        live.kill()
        live.wait()
        zombie.wait()
    by_pid = {p["pid"]: p for p in check.evidence["processes"]}
    assert by_pid[zombie.pid]["status"] == "zombie"
    assert by_pid[zombie.pid]["name"] == "pt_main_thread"
    assert by_pid[live.pid]["status"] in ("sleeping", "running")
    assert "torchrun --nproc-per-node=8" in by_pid[live.pid]["cmdline"]
    assert check.status == "fail" and f"pid {zombie.pid} pt_main_thread zombie" in check.message
    assert os.getpid() not in by_pid  # never itself


def test_a_shell_wrapper_that_mentions_torchrun_is_not_a_trainer():
    """`bash -c '... torchrun ...'` only launches; its torchrun child is what counts."""
    wrapper = subprocess.Popen(["bash", "-c", "sleep 60; echo torchrun --nproc-per-node=8"])
    try:
        wait_for(lambda: psutil.Process(wrapper.pid).children(), 20, interval=0.05,
                 what="bash to start its child")
        check = host.check_leftovers(settings()["host"])
    finally:
        for child in psutil.Process(wrapper.pid).children():
            child.kill()
        wrapper.kill()
        wrapper.wait()
    assert wrapper.pid not in {p["pid"] for p in check.evidence["processes"]}


# --------------------------------------------------------------------------- network
def net(**cfg):
    """Network checks against the fixture /sys (eth0 up, ib0 down, mlx5_1 port down)."""
    return {c.id: c for c in network.check_network(Request(), settings(network=cfg)["network"],
                                                   str(FIXTURES / "sys"))}


def test_network_fixture_interfaces_and_infiniband_ports():
    c = net()
    assert c["network.interfaces"].status == "warn"  # eth0 up, ib0 down, lo ignored
    assert c["network.interfaces"].evidence["interfaces"] == {"eth0": "up", "ib0": "down"}
    assert c["network.infiniband"].status == "warn"
    assert "mlx5_1/1 DOWN/Disabled" in c["network.infiniband"].message
    assert c["network.peers"].status == "skipped"
    required = net(require_interfaces=["ib0"], require_ib_ports=["mlx5_1/1"])
    assert required["network.interfaces"].status == "fail"
    assert "ib0" in required["network.interfaces"].message
    assert required["network.infiniband"].status == "fail"
    assert net(ignore_interfaces=["lo", "ib*"])["network.interfaces"].status == "ok"


def test_network_no_infiniband_is_absent(tmp_path):
    (tmp_path / "class" / "net").mkdir(parents=True)
    c = {x.id: x for x in network.check_network(Request(), settings()["network"], str(tmp_path))}
    assert c["network.infiniband"].status == "absent"
    assert c["network.interfaces"].status == "fail"  # no interface at all


def test_network_real_peers_closed_listening_and_master(tmp_path):
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connect is refused
        up, down = listening.getsockname()[1], closed.getsockname()[1]
        request = Request(peers=[("127.0.0.1", up), ("127.0.0.1", down)],
                          master=("127.0.0.1", down))
        c = {x.id: x for x in network.check_network(request, settings()["network"],
                                                    str(FIXTURES / "sys"))}
    assert c[f"network.peer.127.0.0.1:{up}"].status == "ok"
    assert c[f"network.peer.127.0.0.1:{up}"].evidence["connect_seconds"] < 2
    assert c[f"network.peer.127.0.0.1:{down}"].status == "fail"
    assert "refused" in c[f"network.peer.127.0.0.1:{down}"].message
    assert c["network.master"].status == "warn"  # the host answered; rank 0 not up yet


def test_network_address_parsing():
    assert network.parse_address("node7:29500", "--peer") == ("node7", 29500)
    assert network.parse_address("[fe80::1]:80", "--peer") == ("fe80::1", 80)
    for bad in ("node7", ":80", "node7:0", "node7:x", "node7:70000"):
        with pytest.raises(Exception, match="not HOST:PORT"):
            network.parse_address(bad, "--peer")


CHRONY = """Reference ID    : C0A80101 (192.168.1.1)
Stratum         : 3
System time     : {offset} seconds {way} of NTP time
Last offset     : +0.000012345 seconds
Leap status     : {leap}
"""


def test_network_clock_from_chrony_output():
    cfg = settings()["network"]
    def verdict(offset, way="slow", leap="Normal"):
        return network.clock_from_chrony(CHRONY.format(offset=offset, way=way, leap=leap), cfg)
    assert network.parse_chrony(CHRONY.format(offset="0.25", way="fast", leap="Normal")) == (
        0.25, "Normal")
    assert verdict("0.000021").status == "ok"
    assert verdict("0.300000").status == "warn"
    assert verdict("2.5", "fast").status == "fail"
    assert verdict("0.000021", leap="Not synchronised").status == "warn"


def test_network_clock_on_this_machine_is_checked_or_skipped_with_a_reason():
    c = network.check_clock(settings()["network"])
    assert c.status in ("ok", "warn", "fail", "skipped")
    if c.status == "skipped":
        assert "not readable" in c.message


# --------------------------------------------------------------------------- software
def test_software_versions_pins_and_env():
    torch_version = metadata.version("torch")
    environ = {"NCCL_DEBUG": "INFO", "NCCL_IB_HCA": "mlx5_0",
               "TORCH_HUB_TOKEN": "hf_abcdefghijklmnopqrstuvwx", "HOME": "/root"}
    cfg = settings(software={"expect_versions": {"torch": torch_version.split("+")[0],
                                                 "python": "3", "nccl": "2.27"},
                             "expect_env": {"NCCL_IB_HCA": "mlx5_0", "NCCL_SOCKET_IFNAME": "ib0"}})
    c = checks_of(["software"], cfg, environ=environ)
    assert c["software.versions"].status == "ok"
    assert c["software.versions"].evidence["versions"]["torch"] == torch_version
    assert c["software.versions"].evidence["versions"]["driver"] == ""  # no NVML: unknown
    assert c["software.pin.torch"].status == "ok"
    assert c["software.pin.python"].status == "ok"
    assert c["software.pin.nccl"].status == "fail"  # CPU torch has no NCCL
    env = c["software.env"]
    assert env.status == "fail" and "NCCL_SOCKET_IFNAME unset (expected ib0)" in env.message
    assert env.evidence["variables"]["NCCL_DEBUG"] == "INFO"
    assert "hf_abcdef" not in json.dumps(env.evidence)
    assert "HOME" not in env.evidence["variables"]


def test_software_version_matching():
    assert software.version_matches("2.13.0+cu128", "2.13.0")
    assert software.version_matches("2.13.0", "2.13")
    assert not software.version_matches("2.13.1", "2.13.0")
    assert not software.version_matches("2.130", "2.13")


def test_software_broken_interpreter_fails(tmp_path):
    c = checks_of(["software"], python=str(tmp_path / "no-python"))
    assert c["software.versions"].status == "fail"
    assert "cannot run" in c["software.versions"].message


# --------------------------------------------------------------------------- config
def test_defaults_file_loads_with_sizes_in_bytes():
    cfg = load_settings(None)
    assert cfg["storage"]["min_free_bytes"] == 5 * GIB
    assert cfg["host"]["min_shm_bytes"] == GIB
    assert set(cfg) == {"sys_root", "proc_root", "gpu", "sdc", "storage", "host", "network",
                        "software"}


@pytest.mark.parametrize("data, key, problem", [
    ({"gpu": {"max_temprature_celsius": 80}}, "gpu.max_temprature_celsius", "unknown key"),
    ({"storage": {"min_free_bytes": "lots"}}, "storage.min_free_bytes", "must be a size"),
    ({"host": {"warn_available_memory_ratio": 2}}, "host.warn_available_memory_ratio",
     "between 0 and 1"),
    ({"host": {"trainer_patterns": ["(unclosed"]}}, "host.trainer_patterns",
     "bad regular expression"),
    ({"software": {"expect_versions": {"cudnn": "9"}}}, "software.expect_versions",
     "cannot pin 'cudnn'"),
    ({"gpu": {"xid_ignore": ["79"]}}, "gpu.xid_ignore", "list of ints"),
    ({"network": "fast"}, "network", "must be a mapping"),
    ({"nettwork": {}}, "nettwork", "unknown key"),
])
def test_bad_config_exits_2_naming_file_and_key(tmp_path, data, key, problem):
    path = write_config(tmp_path / "preflight.yaml", data)
    done = cli("--config", str(path), "--only", "host")
    assert done.returncode == 2, done.stdout + done.stderr
    assert str(path) in done.stderr and f"key '{key}'" in done.stderr
    assert problem in done.stderr
    assert "Traceback" not in done.stderr


def test_bad_usage_exits_2(tmp_path):
    for args, words in ((["--peer", "node7"], "--peer"),
                        (["--expect-version", "torch"], "NAME=VERSION"),
                        (["--expect-version", "cudnn=9"], "cannot pin 'cudnn'"),
                        (["--checkpoint-bytes", "3 apples"], "must be a size"),
                        (["--config", str(tmp_path / "missing.yaml")], "file not found"),
                        (["--only", "gpus"], "Invalid value")):
        done = cli(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert words in done.stderr, (args, done.stderr)


def test_print_defaults_is_a_valid_config(tmp_path):
    done = cli("--print-defaults")
    assert done.returncode == 0 and "# trainwatch preflight" in done.stdout
    path = tmp_path / "copy.yaml"
    path.write_text(done.stdout)
    assert load_settings(path) == load_settings(None)


# --------------------------------------------------------------------------- CLI
def test_help_lists_the_options():
    done = cli("--help")
    assert done.returncode == 0
    for option in ("--run-dir", "--checkpoint-dir", "--data-dir", "--checkpoint-bytes",
                   "--expect-gpus", "--xid-watch", "--peer", "--master", "--expect-version",
                   "--config", "--strict", "--json", "--only", "--skip"):
        assert option in done.stdout
    top = subprocess.run([sys.executable, "-m", "trainwatch", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert "preflight" in top.stdout


def test_json_schema_and_exit_codes(tmp_path):
    """One run with a failing peer, one clean, one that only warns (then --strict)."""
    config = write_config(tmp_path / "pf.yaml", {"storage": {"min_free_bytes": 0}})
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        bad = cli("--json", "--skip", "software", "--run-dir", str(tmp_path), "--config",
                  str(config), "--sys-root", str(FIXTURES / "sys"), "--proc-root",
                  str(FIXTURES / "proc"), "--peer", f"127.0.0.1:{port}")
    assert bad.returncode == 1, bad.stderr
    data = json.loads(bad.stdout)
    assert set(data) == {"schema", "node", "time", "strict", "fit", "exit_code", "counts",
                         "checks"}
    assert data["schema"] == "trainwatch.preflight/1"
    assert data["fit"] is False and data["exit_code"] == 1 and data["strict"] is False
    assert sum(data["counts"].values()) == len(data["checks"])
    for check in data["checks"]:
        assert set(check) == {"id", "group", "status", "message", "evidence", "doc", "runbook"}
        assert check["status"] in STATUSES and check["message"]
        assert check["id"].startswith(check["group"] + ".")
        assert check["doc"].startswith("docs/preflight.md#")
        if check["runbook"]:
            assert (Path(__file__).resolve().parents[2] / "trainwatch" / "runbooks" / f"{check['runbook']}.md").exists()
    ids = {c["id"]: c for c in data["checks"]}
    assert ids[f"network.peer.127.0.0.1:{port}"]["status"] == "fail"
    assert ids["software.all"]["status"] == "skipped"
    assert ids["storage.run.writable"]["evidence"]["mountpoint"] == "/"  # from the fixture mounts

    clean = cli("--json", "--only", "storage", "--run-dir", str(tmp_path), "--config",
                str(config))
    assert clean.returncode == 0, clean.stdout
    assert json.loads(clean.stdout)["fit"] is True

    warn_only = write_config(tmp_path / "warn.yaml", {"storage": {"min_free_bytes": 0,
                                                                  "warn_free_ratio": 1.0}})
    args = ["--only", "storage", "--run-dir", str(tmp_path), "--config", str(warn_only)]
    assert cli(*args).returncode == 0
    strict = cli(*args, "--strict")
    assert strict.returncode == 1
    assert "NOT FIT" in strict.stdout and "--strict" in strict.stdout


def test_human_output_is_plain_text_with_the_runbook_of_a_failure(tmp_path):
    done = cli("--only", "storage", "--checkpoint-dir", str(tmp_path / "gone"))
    assert done.returncode == 1
    assert "\x1b[" not in done.stdout  # not a terminal: no colour codes
    row = next(line for line in done.stdout.splitlines() if "storage.checkpoint.writable" in line)
    assert row.split()[0] == "fail"
    # the table wraps a long message between words (where depends on tmp_path's length)
    assert "does not exist" in " ".join(done.stdout.split())
    assert "read: trainwatch runbook StorageFull, docs/preflight.md#storage" in done.stdout


def test_docs_name_every_check_and_json_key():
    text = DOCS.read_text()
    for key in ("schema", "node", "time", "strict", "fit", "exit_code", "counts", "checks",
                "evidence", "runbook", "doc"):
        assert f"`{key}`" in text, key
    ids = ["gpu.count", "gpu.ecc", "gpu.xid", "gpu.thermal", "gpu.memory", "sdc.suspect",
           "storage.<role>.writable", "storage.<role>.readable", "storage.<role>.space",
           "storage.<role>.inodes", "storage.dirs", "host.shm", "host.nofile", "host.memlock",
           "host.memory", "host.leftovers", "network.interfaces", "network.infiniband",
           "network.peer.<host>:<port>", "network.master", "network.peers", "network.clock",
           "software.versions", "software.pin.<name>", "software.pins", "software.env",
           "<group>.all", "<group>.error"]
    for check_id in ids:
        assert f"`{check_id}`" in text, check_id
    assert "--print-defaults" in text


# --------------------------------------------------------------------------- deploy
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _slurm_prolog(tmp_path: Path, config: dict | None, args: str = "--only storage"):
    """deploy/slurm/preflight.sh with the real `trainwatch`, and a stand-in `scontrol`
    that records its arguments (there is no Slurm on this machine)."""
    tmp_path.mkdir()
    calls = tmp_path / "scontrol.calls"
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    scontrol.chmod(0o755)
    env = {**os.environ, "SLURM_JOB_ID": "4242", "SLURMD_NODENAME": "gpu17",
           "SCONTROL": str(scontrol), "TRAINWATCH_BIN": str(Path(sys.executable).with_name(
               "trainwatch")), "TRAINWATCH_PYTHON": sys.executable,
           "TRAINWATCH_RUNS_ROOT": str(tmp_path / "runs"),
           "TRAINWATCH_PREFLIGHT_LOG_DIR": str(tmp_path / "log"),
           "TRAINWATCH_PREFLIGHT_CONFIG": str(tmp_path / "preflight.yaml"),
           "TRAINWATCH_PREFLIGHT_ARGS": args}
    if config is not None:
        write_config(tmp_path / "preflight.yaml", config)
    done = subprocess.run(["bash", str(DEPLOY / "slurm" / "preflight.sh")], env=env,
                          capture_output=True, text=True, timeout=120)
    return done, calls.read_text() if calls.exists() else ""


def test_slurm_prolog_drains_the_node_only_on_a_failed_check(tmp_path):
    fine, calls = _slurm_prolog(tmp_path / "a", {"storage": {"min_free_bytes": 0}})
    assert fine.returncode == 0, fine.stderr
    assert calls == ""
    report = json.loads((tmp_path / "a" / "log" / "preflight-4242.json").read_text())
    assert report["fit"] is True

    full, calls = _slurm_prolog(tmp_path / "b", {"storage": {"min_free_bytes": "1PiB"}})
    assert full.returncode == 1
    assert calls.startswith("update NodeName=gpu17 State=DRAIN Reason=trainwatch preflight: "
                            "storage.run.space (job 4242)")

    typo, calls = _slurm_prolog(tmp_path / "c", {"storage": {"min_fre_bytes": 0}})
    assert typo.returncode == 0 and calls == ""  # a bad config never drains a node
    assert "node not drained" in typo.stderr
    assert "min_fre_bytes" in (tmp_path / "c" / "log" / "preflight-4242.json.err").read_text()


def test_kubernetes_initcontainer_runs_a_valid_preflight():
    from trainwatch.preflight.cli import preflight
    docs = [d for d in yaml.safe_load_all(
        (DEPLOY / "kubernetes" / "preflight-initcontainer.yaml").read_text()) if d]
    pod = docs[0]["spec"]["template"]["spec"]
    init = pod["initContainers"][0]
    assert init["args"][0] == "preflight"
    ctx = preflight.make_context("preflight", list(init["args"][1:]))  # options parse
    assert ctx.params["expect_gpus"] == 8 and ctx.params["checkpoint_bytes"] == "40GiB"
    trainer = pod["containers"][0]
    assert init["image"] == trainer["image"]
    assert init["volumeMounts"] == trainer["volumeMounts"]  # checks what the trainer gets
    assert init["resources"] == trainer["resources"]
