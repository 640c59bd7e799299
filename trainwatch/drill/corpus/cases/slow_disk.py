"""Rank 1 reads its data from a slow disk: an ext4 file system on a loop device whose reads
a blkio cgroup (v1 ``blkio.throttle.read_bps_device``) or an io cgroup (v2 ``io.max``)
throttles to 64 KiB/s, the rank moved into it at the fault step. Each step it reads
256 KiB past the page cache (POSIX_FADV_DONTNEED first), as a rank whose shard is on a
failing or saturated disk does: about 4 s a step in the kernel's disk wait (D state).
"""

import os
import subprocess
import time
from pathlib import Path

from trainwatch.drill.corpus.case import Case, Context, Expect

READ_BPS = 64 * 1024
CHUNK = 256 * 1024
SIZE_MB = 32


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done.stdout.strip()


def _cgroup_base() -> tuple[Path, bool]:
    """The io controller's folder (v2) or blkio's (v1), and whether it is v1."""
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    if v2.exists() and "io" in v2.read_text().split():
        return Path("/sys/fs/cgroup"), False
    return Path("/sys/fs/cgroup/blkio"), True


def make_disk(work: Path) -> dict[str, str]:
    image, mount = work / "disk.img", work / "slowdisk"
    with open(image, "wb") as fh:
        fh.truncate(SIZE_MB << 20)
    loop = _run("losetup", "--find", "--show", str(image))
    (work / "loop").write_text(loop)
    _run("mkfs.ext4", "-q", str(image))
    mount.mkdir()
    _run("mount", loop, str(mount))
    (work / "mounted").write_text(str(mount))
    (mount / "shard.bin").write_bytes(os.urandom(8 << 20))
    base, v1 = _cgroup_base()
    group = base / f"trainwatch-corpus-disk-{os.getpid()}-{time.time_ns()}"
    group.mkdir()
    (work / "io-cgroup").write_text(str(group))
    dev = os.stat(loop).st_rdev
    majmin = f"{os.major(dev)}:{os.minor(dev)}"
    if v1:
        (group / "blkio.throttle.read_bps_device").write_text(f"{majmin} {READ_BPS}")
    else:
        (group / "io.max").write_text(f"{majmin} rbps={READ_BPS}")
    return {}


def remove_disk(work: Path) -> None:
    marker = work / "io-cgroup"
    if marker.exists():
        group, deadline = Path(marker.read_text()), time.time() + 30
        while group.exists():
            try:
                group.rmdir()
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.5)
    if (work / "mounted").exists():
        _run("umount", (work / "mounted").read_text())
        (work / "mounted").unlink()
    if (work / "loop").exists():
        _run("losetup", "-d", (work / "loop").read_text())
        (work / "loop").unlink()
    (work / "disk.img").unlink(missing_ok=True)


def enter_slow_disk(ctx: Context) -> None:
    group = Path((ctx.workdir / "io-cgroup").read_text())
    (group / "cgroup.procs").write_text(str(os.getpid()))


def read_shard(ctx: Context, index: int) -> None:
    if not (ctx.faulty and ctx.step >= ctx.fault_step):
        return
    path = ctx.workdir / "slowdisk" / "shard.bin"
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = (index * CHUNK) % ((8 << 20) - CHUNK)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.pread(fd, CHUNK, offset)
    finally:
        os.close(fd)


CASE = Case(
    kind="slow_disk",
    simulates="a slow disk: rank 1's data shard is on a disk that reads at 64 KiB/s (a "
              "failing or saturated device); rank 1 waits in the kernel for each read",
    expect=Expect(category=("rank_stuck", "straggler", "storage"), ranks=(1,),
                  cause=("uninterruptible I/O",)),
    fault=enter_slow_disk, phase="data", item=read_shard, prepare=make_disk,
    cleanup=remove_disk, needs=("root", "loop devices", "blkio/io cgroups"))
