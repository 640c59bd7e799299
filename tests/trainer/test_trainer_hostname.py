"""A one-node `trainwatch train` starts whatever the hostname resolves to (issue #34).

torchrun --standalone handed the workers MASTER_ADDR=<hostname> while their store listens
on 127.0.0.1 only: where the name resolves to Debian's 127.0.1.1 or to nothing, every
rank sat in init_process_group. Each job here runs in a UTS + mount namespace of its own
with a hostname of its own, a private /etc/hosts that maps it as the field does, and a
private nsswitch.conf (`hosts: files`) so that no DNS server can answer for it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess

import pytest

from conftest import TRAIN, kill_tree
from trainwatch.rundir.run_dir import RunDir

# Seconds the job may take from start to exit; a loaded 2-core machine needs ~40.
BOUND = 150
IN_NAMESPACE = ('hostname "$TW_HOSTNAME" && mount --bind "$TW_HOSTS" /etc/hosts && '
                'mount --bind "$TW_NSSWITCH" /etc/nsswitch.conf && exec "$@"')


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root for a UTS and mount namespace"
    if shutil.which("unshare") is None:
        return "needs util-linux's unshare"
    done = subprocess.run(["unshare", "--uts", "--mount", "true"], capture_output=True,
                          text=True)
    return None if done.returncode == 0 else f"unshare failed: {done.stderr.strip()}"


pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))


@pytest.mark.slow
@pytest.mark.parametrize("resolves_to", ["127.0.1.1", None], ids=["debian-127.0.1.1",
                                                                  "unresolvable"])
def test_a_one_node_job_starts_whatever_the_hostname_resolves_to(tmp_path, resolves_to):
    name = f"tw-host-{secrets.token_hex(3)}"
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n" + (f"{resolves_to} {name}\n" if resolves_to
                                                 else ""))
    nsswitch = tmp_path / "nsswitch.conf"
    nsswitch.write_text("hosts: files\n")
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TW_HOSTNAME": name, "TW_HOSTS": str(hosts),
           "TW_NSSWITCH": str(nsswitch)}
    for key in ("TRAINWATCH_FAULT", "TRAINWATCH_NODE", "PET_LOCAL_ADDR"):
        env.pop(key, None)
    proc = subprocess.Popen(["unshare", "--uts", "--mount", "sh", "-c", IN_NAMESPACE, "sh",
                             *TRAIN, "--nproc-per-node", "2", "--run-dir", str(run_dir),
                             "--steps", "2", "--max-restarts", "0"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=BOUND)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, _ = proc.communicate()
        events = [e["event"] for e in RunDir(run_dir).events()]
        pytest.fail(f"the job did not finish within {BOUND} s on a host named {name} "
                    f"(resolving to {resolves_to}); journal: {events}\n{out[-4000:]}")
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, out[-4000:]
    run = RunDir(run_dir)
    assert [e["host"] for e in run.events("launcher_started")] == [name]
    assert sorted(s["state"] for s in run.statuses().records) == ["finished", "finished"]
