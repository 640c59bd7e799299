"""torchrun's stores started by `trainwatch train` listen on one address (issue #22, item 6).

torch's TCPStore server listens on every interface whatever host it is given; the
launcher's torchrun and rank 0 make theirs through trainer/stores.py, bound to
$TRAINWATCH_STORE_ADDR. The whole job is checked with `ss` in
tests/deploy/test_deploy_shipped_e2e.py; here one store, in a child process, and the launch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainwatch.contract.env import STORE_ADDR_ENV
from trainwatch.rundir.run_dir import RunDir
from trainwatch.trainer.launcher import LaunchSpec, torchrun_command, torchrun_env

STORE = """
import datetime, os, subprocess, sys
from trainwatch.trainer import stores
where = sys.argv[1]
stores.bind_stores(creators=stores.TORCHRUN_CREATORS if where == "torchrun"
                   else stores.RANK_CREATORS)
if where == "torchrun":  # its rendezvous store
    from torch.distributed.elastic.utils.distributed import create_c10d_store
    store = create_c10d_store(True, "localhost", 0, 1, 10)
else:  # rank 0's store for the workers (init_process_group, env://)
    from torch.distributed.rendezvous import _create_c10d_store
    store = _create_c10d_store("localhost", 0, 0, 1, datetime.timedelta(seconds=10))
store.set("k", "v")
assert store.get("k") == b"v"
mine = [l for l in subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True).stdout
        .splitlines() if f"pid={os.getpid()}," in l]
print("\\n".join(mine))
"""


@pytest.mark.skipif(not shutil.which("ss"), reason="needs ss")
@pytest.mark.parametrize("where,bound", [("torchrun", True), ("rank", True),
                                         ("rank", False)])
def test_a_store_server_listens_on_the_given_address_only(where, bound):
    env = {**os.environ}
    env.pop(STORE_ADDR_ENV, None)
    if bound:
        env[STORE_ADDR_ENV] = "127.0.0.1"
    out = subprocess.run([sys.executable, "-c", STORE, where], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    local = [line.split()[3] for line in out.stdout.splitlines()]
    assert local, out.stdout
    if bound:
        assert all(a.startswith("127.0.0.1:") for a in local), local
    else:  # torch's own behaviour, which is why the binding exists
        assert any(a.startswith(("*:", "0.0.0.0:", "[::]:")) for a in local), local


def test_the_launch_binds_one_node_to_loopback_and_several_to_their_address(tmp_path):
    run = RunDir(Path(tmp_path) / "r").create()
    one = LaunchSpec(run.root, 2)
    assert torchrun_command(one, run)[1:3] == ["-m", "trainwatch.trainer.stores"]
    assert torchrun_env(one, run)[STORE_ADDR_ENV] == "127.0.0.1"
    # ...and the rendezvous and MASTER_ADDR on loopback too, not the hostname that
    # --standalone advertises (tests/trainer/test_trainer_hostname.py runs it)
    cmd = torchrun_command(one, run)
    assert "--standalone" not in cmd
    assert {"--nnodes=1", "--rdzv-endpoint=127.0.0.1:0", "--local-addr=127.0.0.1"} <= set(cmd)
    given = LaunchSpec(run.root, 2, local_addr="10.0.0.2")
    assert {"--rdzv-endpoint=10.0.0.2:0", "--local-addr=10.0.0.2"} <= set(
        torchrun_command(given, run))
    assert torchrun_env(given, run)[STORE_ADDR_ENV] == "10.0.0.2"
    several = LaunchSpec(run.root, 2, nnodes=2, rdzv_endpoint="10.0.0.1:29400",
                         local_addr="10.0.0.2")
    assert torchrun_env(several, run)[STORE_ADDR_ENV] == "10.0.0.2"
    cmd = torchrun_command(several, run)
    assert {"--nnodes=2", "--rdzv-endpoint=10.0.0.1:29400", "--local-addr=10.0.0.2"} <= set(cmd)
