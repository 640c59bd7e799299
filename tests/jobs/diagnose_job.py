"""A small gloo training loop with trainwatch telemetry and injectable faults, for diagnose tests.

    torchrun --standalone --nproc-per-node N tests/jobs/diagnose_job.py RUN_DIR STEPS

Faults (environment): FAULT=data_fifo|worker_fifo|flock|extra_collective|size_mismatch|
skip_side|regex|oom|slow|checkpoint|killed_peer_busy|racing, FAULT_RANK, FAULT_STEP, FAULT_ARG (FIFO
path, lock file path, extra seconds per step, checkpoint interval, the others' seconds, or
racing's ``SECOND:DELAY:HOW``);
DEADLOCK_RANK: that rank's threads deadlock on two locks at FAULT_STEP (besides FAULT, so one
job can carry two blocked ranks).
ABORT_ON_ERROR=1: an uncaught error aborts the rank (SIGABRT), as NCCL's watchdog does.
worker_fifo: a DataLoader worker process of the faulty rank blocks on the FIFO; skip_side:
every step also all-reduces on a side group in a phase of its own, "metrics" (no
collective phase by name), which the faulty rank skips once; regex: the
faulty rank runs a catastrophic regular expression (busy in C, holding the GIL); oom: the
faulty rank allocates memory until the kernel kills it; killed_peer_busy: the faulty rank
SIGKILLs itself at FAULT_STEP while the others spend FAULT_ARG seconds loading that step's
batch, stopping on SIGTERM only after the step (as ``Checkpoints`` does); racing: at
FAULT_STEP the ranks agree on a moment (CLOCK_MONOTONIC, shared on one host), the faulty
rank dies at it and rank SECOND DELAY seconds later, HOW: ``exit`` (exit codes 3 and 4),
``raise`` (a RuntimeError each) or ``kill`` (SIGKILL, then SIGSEGV) — two deaths within one
torchrun poll, with a known first.
Gradients are all-reduced by hand (one flat tensor per step) so each step issues
exactly one training collective, plus the telemetry's timing exchange.
"""

import fcntl
import hashlib
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from trainwatch.rank.telemetry import Telemetry

run_dir, steps = Path(sys.argv[1]), int(sys.argv[2])
FAULT = os.environ.get("FAULT", "")
FAULT_RANK = int(os.environ.get("FAULT_RANK", "1"))
FAULT_STEP = int(os.environ.get("FAULT_STEP", "20"))
FAULT_ARG = os.environ.get("FAULT_ARG", "")
DEADLOCK_RANK = int(os.environ.get("DEADLOCK_RANK", "-1"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.03"))

dist.init_process_group("gloo")
if os.environ.get("ABORT_ON_ERROR") == "1":
    report = sys.excepthook  # torch's: prints the error with a [rankN]: prefix

    def abort(*exc_info):
        report(*exc_info)
        sys.stderr.flush()
        os.abort()
    sys.excepthook = abort
rank = dist.get_rank()
faulty = rank == FAULT_RANK
stop_requested = False
if FAULT == "killed_peer_busy" and not faulty:
    def request_stop(signum, frame):
        global stop_requested
        stop_requested = True
    signal.signal(signal.SIGTERM, request_stop)


class Batches(Dataset):
    """Random regression batches; the faulty rank's item FAULT_STEP reads a FIFO nobody writes."""

    def __len__(self):
        return 10**9

    def __getitem__(self, index):
        if FAULT in ("data_fifo", "worker_fifo") and faulty and index == FAULT_STEP:
            with open(FAULT_ARG, "rb") as fifo:
                fifo.read(1)
        g = torch.Generator().manual_seed(index * 100 + rank)
        return torch.randn(32, generator=g)


def busy_in_regex():
    """Backtracking that takes longer than any test waits: sre holds the GIL throughout."""
    return re.match(r"(a+)+$", "a" * 40 + "b")


def allocate_until_killed():
    """Touch memory in 64 MiB pieces until the OOM killer ends this process."""
    hog = []
    while True:
        hog.append(b"\x01" * (64 << 20))


def die_racing(step):
    """racing: every rank learns the moment; the two dying ranks die at it, DELAY apart."""
    second, delay, how = FAULT_ARG.split(":")
    moment = torch.tensor([time.monotonic() + 0.3], dtype=torch.float64)
    dist.all_reduce(moment, op=dist.ReduceOp.MAX)
    if rank not in (FAULT_RANK, int(second)):
        return
    at = moment.item() + (float(delay) if rank == int(second) else 0.0)
    while time.monotonic() < at:
        time.sleep(min(0.001, max(0.0, at - time.monotonic())))
    first = rank == FAULT_RANK
    if how == "raise":
        raise RuntimeError(f"rank {rank} failed on its own at step {step}")
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL if first else signal.SIGSEGV)
    os._exit(3 if first else 4)


def take_file_lock(path):
    """Blocks in the kernel (flock) while another process holds the lock."""
    lock_file = open(path, "a")
    fcntl.flock(lock_file, fcntl.LOCK_EX)


LOCK_A, LOCK_B = threading.Lock(), threading.Lock()


def deadlock():
    """Two threads take two locks in opposite order; the barrier makes the deadlock certain."""
    both_hold_one = threading.Barrier(2)

    def helper():
        with LOCK_B:
            both_hold_one.wait()
            with LOCK_A:
                pass

    threading.Thread(target=helper, name="cache-refresher", daemon=True).start()
    with LOCK_A:
        both_hold_one.wait()
        with LOCK_B:
            pass


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
target = torch.nn.Linear(32, 1)
workers = 2 if FAULT == "worker_fifo" else 0
loader = iter(DataLoader(Batches(), batch_size=None, num_workers=workers))
side = dist.new_group(list(range(dist.get_world_size()))) if FAULT == "skip_side" else None


def save_checkpoint(step):
    """Write checkpoints/step-N/ (tmp dir + rename, manifest with sha256); journal failures."""
    final = run_dir / "checkpoints" / f"step-{step:08d}"
    tmp = final.with_name(".tmp-" + final.name)
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        data = os.urandom(256 * 1024)  # stands in for a model + optimizer state
        (tmp / "model.bin").write_bytes(data)
        manifest = {"format": "trainwatch.checkpoint", "version": 1, "step": step,
                    "created_at": time.time(), "files": {
                        "model.bin": {"bytes": len(data),
                                      "sha256": hashlib.sha256(data).hexdigest()}}}
        (tmp / "manifest.json").write_text(json.dumps(manifest))
        tmp.rename(final)
        tel.event("checkpoint_saved", step=step, path=str(final), time=time.time())
        tel.set_checkpoint(step=step, path=str(final), time=time.time(), ok=True)
    except OSError as exc:
        tel.event("checkpoint_failed", step=step, error=str(exc), path=str(final))
        tel.set_checkpoint(step=step, path=str(final), time=time.time(), ok=False,
                           error=str(exc))
        for leftover in tmp.glob("*") if tmp.exists() else []:
            leftover.unlink()
        if tmp.exists():
            tmp.rmdir()


tel = Telemetry.from_env(run_dir, heartbeat_interval=0.2, exchange_every=5).start()
for step in range(steps):
    with tel.step(step) as s:
        with tel.phase("data"):
            x = next(loader).unsqueeze(0).repeat(16, 1)
            y = target(x).detach()
            if FAULT == "killed_peer_busy" and step == FAULT_STEP and not faulty:
                time.sleep(float(FAULT_ARG))  # a slow batch, outside any collective
        if FAULT == "killed_peer_busy" and step == FAULT_STEP and faulty:
            os.kill(os.getpid(), signal.SIGKILL)
        with tel.phase("forward"):
            if faulty and step == FAULT_STEP and FAULT == "flock":
                take_file_lock(FAULT_ARG)
            if rank == DEADLOCK_RANK and step == FAULT_STEP:
                deadlock()
            if faulty and step == FAULT_STEP and FAULT == "regex":
                busy_in_regex()
            if faulty and step == FAULT_STEP and FAULT == "oom":
                allocate_until_killed()
            time.sleep(STEP_SLEEP + (float(FAULT_ARG) if FAULT == "slow" and faulty else 0))
            loss = torch.nn.functional.mse_loss(model(x), y)
        with tel.phase("backward"):
            opt.zero_grad()
            loss.backward()
        with tel.phase("allreduce"):
            if FAULT == "racing" and step == FAULT_STEP:
                die_racing(step)
            if FAULT == "extra_collective" and faulty and step == FAULT_STEP:
                dist.barrier()  # the bug: a collective only this rank issues
            flat = torch.cat([p.grad.flatten() for p in model.parameters()])
            if FAULT == "size_mismatch" and faulty and step == FAULT_STEP:
                dist.all_reduce(torch.cat([flat, torch.zeros(4096)]))  # the bug: a bigger one
            dist.all_reduce(flat)
            offset = 0
            for p in model.parameters():
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p) / dist.get_world_size())
                offset += p.numel()
        if side is not None:
            with tel.phase("metrics"):  # a user's phase that holds a collective (issue #36)
                if not (faulty and step == FAULT_STEP):
                    dist.all_reduce(torch.ones(1), group=side)  # the bug: one rank skips it
        with tel.phase("optimizer"):
            opt.step()
        s.record(loss=loss, lr=0.01, samples=x.shape[0])
    if stop_requested:
        sys.exit(75)
    if FAULT == "checkpoint" and rank == 0 and (step + 1) % int(FAULT_ARG or 10) == 0:
        with tel.phase("checkpoint"):
            save_checkpoint(step + 1)
tel.close()
dist.destroy_process_group()
