"""Sharded (FSDP2) checkpoints through ``Checkpoints`` side by side with plain
``torch.distributed.checkpoint`` (DCP), as a user's job sees them.

    python benchmarks/sharded_checkpoint.py [--ranks 2] [--mb 50,200] [--rounds 3]
        [--dir DIR] [--json] [--quick]

For each world size in ``--ranks`` and each state size in ``--mb`` (MB of model + AdamW
state over all ranks: a stack of 1024x1024 linear layers, ``fully_shard`` per layer and
whole over a 1-D CPU mesh, one optimizer step taken) one real job runs: ``torchrun
--standalone`` gloo ranks on CPU, ``OMP_NUM_THREADS=1``, writing on the disk holding
``DIR`` (default: a temporary folder in the current directory; not a tmpfs). In the job,
after one warm-up round that is not counted (the first save looks at the state, the first
async save makes its gloo group), every round runs the four saves once each in a rotating
order, then the two resumes in alternating order, so the machine's load hits both sides
alike, and every ratio is taken within a round (paired), then summarised as its median
and min-max over the rounds:

* ``tw_sync``: ``Checkpoints(mode=sync).maybe_save(step, model=, optimizer=)`` then
  ``wait``: every rank's shards written through DCP, fsynced and hashed, the manifest
  written and the directory renamed into place by rank 0 (durable);
* ``dcp_sync``: ``get_state_dict`` + ``dcp.save`` of the same state (DCP's default
  ``FileSystemWriter``, which fsyncs its files);
* ``tw_async``: ``Checkpoints(mode=async).maybe_save`` (the loop is blocked until it
  returns) then ``wait`` (durable);
* ``dcp_async``: ``get_state_dict`` + ``dcp.async_save`` (blocked until it returns), then
  its future's result (durable);
* ``tw_resume``: ``resume(model=, optimizer=)`` of a new ``Checkpoints`` (made before the
  timing: a job makes it anyway) on the run directory ``tw_sync`` wrote: every file's
  digest verified (each rank hashes its own share), then every rank loads through DCP and
  ``set_state_dict``;
* ``dcp_resume``: ``get_state_dict`` + ``dcp.load`` of ``dcp_sync``'s checkpoint +
  ``set_state_dict``.

Each rank times itself from a barrier; the job's time is the slowest rank's. Each rank's
memory is its peak resident set during the operation above its resident set just before
(VmHWM reset through ``/proc/self/clear_refs``; the C heap trimmed first, so memory freed
earlier is not counted as free room), against its own shard (its local model and
optimizer tensors). Saves write into the same state of the file system: what an async
save wrote is deleted after its timing, the sync ones after the resumes.

Goals (issue #33): tw_sync / dcp_sync durable <= 1.1; a rank's extra memory during a
save <= its shard + 10 % (i.e. <= 1.1x the shard: an async save needs one host copy of
the shard, and no rank may hold more, e.g. another rank's shards); tw_async / dcp_async
blocked <= 1; tw_resume / dcp_resume <= 1.1.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

WIDTH = 1024
SAVES = ("tw_sync", "dcp_sync", "tw_async", "dcp_async")
RESUMES = ("tw_resume", "dcp_resume")
RATIOS = {  # name: (numerator, denominator, measure, goal)
    "save_durable_tw_over_dcp": ("tw_sync", "dcp_sync", "seconds", "<= 1.1"),
    "async_blocked_tw_over_dcp": ("tw_async", "dcp_async", "blocked", "<= 1"),
    "async_durable_tw_over_dcp": ("tw_async", "dcp_async", "seconds", ""),
    "resume_tw_over_dcp": ("tw_resume", "dcp_resume", "seconds", "<= 1.1"),
    "save_cpu_tw_over_dcp": ("tw_sync", "dcp_sync", "cpu", ""),
    "resume_cpu_tw_over_dcp": ("tw_resume", "dcp_resume", "cpu", ""),
}


# ---------------------------------------------------------------------------- in a rank
def build(megabytes: int, mesh: Any) -> tuple[Any, Any]:
    """An FSDP2 model of ``megabytes`` MB of state with AdamW (weights a third of it)."""
    import torch
    from torch.distributed.fsdp import fully_shard

    layers = max(1, round(megabytes * 1e6 / 12 / WIDTH**2))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False)
                                  for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, WIDTH)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def shard_bytes(model: Any, opt: Any) -> int:
    """This rank's own state: its local parameters and optimizer tensors."""
    import torch
    from torch.distributed.tensor import DTensor

    def own(t: torch.Tensor) -> int:
        return (t.to_local() if isinstance(t, DTensor) else t).nbytes

    total = sum(own(p) for p in model.parameters())
    return total + sum(own(v) for s in opt.state.values() for v in s.values()
                       if isinstance(v, torch.Tensor))


def timed(run: Callable[[float], dict[str, float]]) -> dict[str, float]:
    """One operation on this rank: seconds from a barrier, CPU seconds, peak memory above
    the resident set just before (the C heap trimmed first)."""
    import torch
    import torch.distributed as dist

    from trainwatch.rehearse.memory import PeakMemory

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    dist.barrier()
    peak = PeakMemory(torch.device("cpu"))
    cpu, started = time.process_time(), time.perf_counter()
    marks = run(started)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "cpu": time.process_time() - cpu,
            "extra_bytes": float(peak.peak_bytes() or 0), **marks}


class Job:
    """The contenders of one rank, on one model, in one folder shared by the ranks."""

    def __init__(self, folder: Path, model: Any, opt: Any):
        import torch.distributed as dist

        from trainwatch.rank.checkpoint import CheckpointConfig
        from trainwatch.rank.checkpoint.checkpoints import Checkpoints

        self.folder, self.model, self.opt = folder, model, opt
        self.rank = dist.get_rank()
        self.config = {mode: CheckpointConfig(mode=mode, every_steps=1, keep_last=1000,
                                              save_final=False) for mode in ("sync", "async")}
        self.ckpts = {mode: Checkpoints(folder / f"tw-{mode}", self.config[mode])
                      for mode in ("sync", "async")}
        self.step = 0
        self.saved: dict[str, Path] = {}
        self.reopened: Any = None

    def state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optimizer": osd}

    def tw_save(self, mode: str) -> Callable[[float], dict[str, float]]:
        def run(started: float) -> dict[str, float]:
            self.step += 1
            ckpt = self.ckpts[mode]
            if not ckpt.maybe_save(self.step, model=self.model, optimizer=self.opt):
                raise SystemExit(f"tw_{mode}: maybe_save did not save step {self.step}")
            blocked = time.perf_counter() - started
            ckpt.wait()
            self.saved[f"tw_{mode}"] = ckpt.checkpointer.folder / f"step-{self.step:08d}"
            return {"blocked": blocked}
        return run

    def dcp_save(self, mode: str) -> Callable[[float], dict[str, float]]:
        import torch.distributed.checkpoint as dcp

        def run(started: float) -> dict[str, float]:
            self.step += 1
            target = self.folder / f"dcp-{mode}-{self.step}"
            if mode == "sync":
                dcp.save(self.state(), checkpoint_id=str(target))
                blocked = time.perf_counter() - started
            else:
                future = dcp.async_save(self.state(), checkpoint_id=str(target))
                blocked = time.perf_counter() - started
                future.result()
            self.saved[f"dcp_{mode}"] = target
            return {"blocked": blocked}
        return run

    def open_resume(self) -> None:
        """The ``Checkpoints`` a restarted job makes anyway (to save): not timed."""
        from trainwatch.rank.checkpoint.checkpoints import Checkpoints

        self.reopened = Checkpoints(self.folder / "tw-sync", self.config["sync"])

    def tw_resume(self, started: float) -> dict[str, float]:
        step = self.reopened.resume(model=self.model, optimizer=self.opt)
        expected = int(self.saved["tw_sync"].name.split("-")[1])
        if step != expected:
            raise SystemExit(f"tw_resume: resumed step {step}, expected {expected}")
        return {}

    def dcp_resume(self, started: float) -> dict[str, float]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self.state()
        dcp.load(state, checkpoint_id=str(self.saved["dcp_sync"]))
        set_state_dict(self.model, self.opt, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        return {}

    def check_and_drop(self, names: tuple[str, ...]) -> None:
        """Rank 0: each trainwatch checkpoint of ``names`` verifies (manifest and sizes);
        then what they wrote is deleted (outside the timings)."""
        import torch.distributed as dist

        from trainwatch.checkpoint_format.manifest import verify

        dist.barrier()
        if self.rank == 0:
            for name in names:
                path = self.saved.pop(name)
                if name.startswith("tw_"):
                    check = verify(path, full=False)
                    if not check.ok:
                        raise SystemExit(f"{name}: {path} does not verify: {check.reason}")
                shutil.rmtree(path)
        dist.barrier()

    def close(self) -> None:
        for mode, ckpt in self.ckpts.items():
            ckpt.close(final=False)
            failed = ckpt.run.events("checkpoint_failed") if self.rank == 0 else []
            if failed:
                raise SystemExit(f"tw_{mode}: saves failed: {failed}")


def rank_main(args: argparse.Namespace) -> None:
    """One rank of the job: warm-up, then ``--rounds`` rounds; rank 0 writes the JSON."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    model, opt = build(args.mb, init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    job = Job(Path(args.folder), model, opt)
    saves = {"tw_sync": job.tw_save("sync"), "dcp_sync": job.dcp_save("sync"),
             "tw_async": job.tw_save("async"), "dcp_async": job.dcp_save("async")}
    resumes = {"tw_resume": job.tw_resume, "dcp_resume": job.dcp_resume}
    rows: list[dict[str, dict[str, float]]] = []
    for r in range(args.rounds + 1):  # round 0: the warm-up
        row: dict[str, dict[str, float]] = {}
        order = list(SAVES[r % 4:] + SAVES[:r % 4])
        for name in order:
            row[name] = timed(saves[name])
            if name.endswith("async"):
                job.check_and_drop((name,))
        for name in (RESUMES if r % 2 == 0 else RESUMES[::-1]):
            if name == "tw_resume":
                job.open_resume()
            row[name] = timed(resumes[name])
        job.reopened.close(final=False)
        job.check_and_drop(("tw_sync", "dcp_sync"))
        row["order"] = order  # type: ignore[assignment]
        rows.append(row)
    job.close()
    mine = {"rank": dist.get_rank(), "shard_bytes": shard_bytes(model, opt), "rows": rows}
    gathered: list[Any] | None = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if gathered is not None:
        Path(args.out).write_text(json.dumps({"world_size": world, "mb": args.mb,
                                              "layers": len(model), "ranks": gathered}))
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- the parent
def run_job(world: int, mb: int, rounds: int, tmp: Path) -> dict[str, Any]:
    folder = tmp / f"w{world}-{mb}mb"
    folder.mkdir()
    out = tmp / f"w{world}-{mb}mb.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(world), __file__, "--rank-job", "--mb", str(mb),
           "--rounds", str(rounds), "--folder", str(folder), "--out", str(out)]
    started = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
    result = json.loads(out.read_text())
    result["job_seconds"] = time.perf_counter() - started
    shutil.rmtree(folder)
    return result


def summarise(job: dict[str, Any]) -> dict[str, Any]:
    """Per round: the job's time (slowest rank), ratios; each rank's extra memory / shard."""
    ranks = job["ranks"]
    rounds = len(ranks[0]["rows"]) - 1

    def job_value(r: int, name: str, measure: str) -> float:
        values = [rk["rows"][r][name][measure] for rk in ranks]
        return sum(values) if measure == "cpu" else max(values)

    def spread(values: list[float]) -> dict[str, Any]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values),
                "per_round": values}

    seconds = {f"{name}_{measure}": spread([job_value(r, name, measure)
                                           for r in range(1, rounds + 1)])
               for name in SAVES + RESUMES for measure in ("seconds", "blocked", "cpu")
               if measure != "blocked" or name.endswith("async")}
    ratios = {}
    for key, (num, den, measure, goal) in RATIOS.items():
        per_round = [job_value(r, num, measure) / job_value(r, den, measure)
                     for r in range(1, rounds + 1)]
        ratios[key] = {**spread(per_round), "goal": goal}
    memory = {}
    for name in SAVES + RESUMES:  # the worst rank of each round, over the rounds
        per_round = [max(rk["rows"][r][name]["extra_bytes"] / rk["shard_bytes"] for rk in ranks)
                     for r in range(1, rounds + 1)]
        memory[name] = {**spread(per_round), "goal": "<= 1.1" if name.startswith("tw_") and
                        name in SAVES else ""}
    shard = [rk["shard_bytes"] for rk in ranks]
    return {"world_size": job["world_size"], "mb": job["mb"], "layers": job["layers"],
            "state_bytes": sum(shard), "shard_bytes": shard, "rounds": rounds,
            "job_seconds": job["job_seconds"], "seconds": seconds, "ratios": ratios,
            "extra_memory_over_shard": memory}


def show(s: dict[str, Any]) -> None:
    mib = [b / 2**20 for b in s["shard_bytes"]]
    print(f"\n{s['world_size']} rank(s), {s['state_bytes'] / 1e6:.0f} MB of state "
          f"({s['layers']} layers; shards {min(mib):.1f}-{max(mib):.1f} MiB), {s['rounds']} "
          f"rounds + 1 warm-up, job {s['job_seconds']:.0f} s")
    print(f"  {'job seconds (slowest rank)':30} {'median':>8} {'min':>8} {'max':>8}")
    for key, v in s["seconds"].items():
        if not key.endswith("_cpu"):
            print(f"  {key:30} {v['median']:8.3f} {v['min']:8.3f} {v['max']:8.3f}")
    print(f"  {'paired ratio':30} {'median':>8} {'min-max':>13}  goal")
    for key, v in s["ratios"].items():
        print(f"  {key:30} {v['median']:8.2f} {v['min']:6.2f}-{v['max']:<6.2f}  {v['goal']}")
    print(f"  {'extra memory / own shard':30} {'median':>8} {'min-max':>13}  goal")
    for key, v in s["extra_memory_over_shard"].items():
        print(f"  {key:30} {v['median']:8.2f} {v['min']:6.2f}-{v['max']:<6.2f}  {v['goal']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2", help="world sizes, comma-separated (1,2,4)")
    parser.add_argument("--mb", default="50,200",
                        help="MB of model + AdamW state over all ranks, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=".", help="a folder on the disk to measure (not tmpfs)")
    parser.add_argument("--quick", action="store_true", help="2 ranks, 50 MB, 3 rounds")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rank-job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_job:
        args.mb = int(args.mb)
        rank_main(args)
        return
    from checkpoint_save import _on_tmpfs  # this folder's plain checkpoint benchmark

    if _on_tmpfs(Path(args.dir)):
        parser.error(f"--dir {args.dir} is on a tmpfs: measure a real disk")
    if args.quick:
        args.ranks, args.mb, args.rounds = "2", "50", 3
    load = [os.getloadavg()[0]]
    results = []
    with tempfile.TemporaryDirectory(prefix="tw-sharded-bench-", dir=args.dir) as tmp:
        for world in (int(w) for w in args.ranks.split(",")):
            for mb in (int(m) for m in args.mb.split(",")):
                results.append(summarise(run_job(world, mb, args.rounds, Path(tmp))))
                if not args.json:
                    show(results[-1])
    load.append(os.getloadavg()[0])
    if args.json:
        print(json.dumps({"load_average_1m": load, "dir": args.dir, "results": results},
                         indent=1))
    else:
        print(f"\nload average {load[0]:.1f} -> {load[1]:.1f}; disk of {args.dir}")


if __name__ == "__main__":
    main()
