"""What in-memory snapshots cost a training loop, and what they save when a rank dies.

    python benchmarks/memory_snapshots.py [--parts overhead,recovery] [--sizes ref,300]
                                          [--repeats 3] [--quick] [--json]

Three questions, each answered as a user's job sees it, on whole processes, with the load
average recorded beside every figure (the machine is shared):

1. **Overhead** (``--parts overhead``): the same training loop, in its own process, with
   ``checkpoint.memory_snapshots`` ``off``, ``every_step`` and ``auto``; one process per mode
   in each repeat, the order rotating between repeats (interleaved A/B), every ratio taken
   within a repeat, then its median and min-max over the repeats. The loop is a user's own
   loop with the ``Checkpoints`` API (``maybe_save`` after every step; durable saves off, so
   only the snapshots are measured), one process, ``OMP_NUM_THREADS=1`` (the writer thread
   has the other core when the machine has one free). Sizes: ``ref``, the reference
   trainer's default GPT (``ModelConfig()``, batch 8 of 64 tokens: a 1.5 MB state), and
   ``N`` (e.g. ``300``): a stack of 1024x1024 linear layers of about N MB of state (weights
   and AdamW's two moments). The figure is the mean step time (all measured steps, the
   snapshot's wait included: with ``auto`` only every K-th step waits) over ``off``'s.
   Also: the loop's wait per snapshot, the K ``auto`` chose and why (its status line), and
   the writer thread's CPU per snapshot (CPU of the threads other than the loop's, over
   ``off``'s, per snapshot taken: writing and hashing; not in the 1 %).
2. **Memory** (same runs): the bytes of the rank's snapshot files in /dev/shm (largest seen
   at a step end, and at the end), the process's resident set over ``off``'s (at the end,
   and its peak ``VmHWM``), against the documented bound of 3 x the state.
3. **Recovery** (``--parts recovery``): ``trainwatch train --nproc-per-node 2
   --max-restarts 1`` with ``checkpoint.every_steps: 10``, snapshots ``every_step``, ``auto``
   and ``off`` (the durable checkpoint alone), one job each per round, the order rotating,
   the same kill step within a round (21, 25, 29, 24, ...: places across the interval):
   rank 1 SIGKILLs itself in that step (``TRAINWATCH_FAULT=kill:...``, as the OOM killer
   would); torchrun restarts both ranks; timed from the kill (rank 1's ``fault_injected``,
   journaled just before the signal) to the first step the restarted job completes (rank
   0's metrics log), in two parts: the restart (kill -> the new ranks' ``rank_started``:
   the survivor's teardown, torchrun's poll and the new processes' start, the same work
   whatever the mode) and the restarted ranks' own (``rank_started`` -> first step: model,
   finding, agreeing on, verifying and loading the state); with the steps recomputed (the
   steps completed before the kill minus the step resumed from, the journal's
   ``checkpoint_resumed``) and where the state came from.

The GPU path (pinned buffers, a side stream) is not measured: no GPU run yet.
``--quick`` is a smoke run of a few seconds (``ref`` only, 1 repeat, few steps, every mode in
this process: its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

MODES = ("off", "every_step", "auto")
HERE = Path(__file__).resolve()


# --------------------------------------------------------------------------- worker side

def _build(size: str) -> tuple[Any, Any, Callable[[], Any]]:
    """Model, AdamW and one step's closure: ``ref`` or N MB of state."""
    import torch

    torch.manual_seed(0)
    if size == "ref":
        from trainwatch.trainer.config import ModelConfig
        from trainwatch.trainer.model import GPT

        cfg = ModelConfig()
        model: Any = GPT(cfg)
        idx = torch.randint(0, 256, (8, cfg.context))

        def loss() -> Any:
            return model(idx, idx)[1]
    else:
        width = 1024
        layers = max(1, int(size) * 1_000_000 // 12 // (width * width))
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                      for _ in range(layers)])
        x = torch.randn(32, width)

        def loss() -> Any:
            return model(x).square().mean()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        loss().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt, step


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _shm_bytes(root: Path | None) -> int:
    if root is None:
        return 0
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def _checkpoints(folder: Path, mode: str) -> Any:
    from trainwatch.rank.checkpoint import CheckpointConfig
    from trainwatch.rank.checkpoint.checkpoints import Checkpoints

    return Checkpoints(folder / f"run-{mode}-{os.getpid()}", CheckpointConfig(
        every_steps=0, save_final=False, fsync=False, memory_snapshots=mode))


def _state_bytes(model: Any, opt: Any) -> int:
    import torch

    tensors = {t.data_ptr(): t for t in [*model.state_dict().values(), *(
        v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _close(ckpt: Any) -> None:
    root = ckpt.checkpointer.memory.root
    ckpt.close()  # the run finished: its snapshots are removed
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)


def time_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One process, one model, a ``Checkpoints`` per mode; blocks of ``block`` steps rotate
    between the modes (each mode counts its own steps), ``rounds`` times. A block's time is
    its steps' wall time, ``maybe_save`` included; the write still in flight at its end is
    waited for outside the time (else it would run into the next mode's block) but inside
    its CPU, which is the process's minus the loop thread's."""
    import torch

    torch.set_num_threads(1)
    model, opt, train_step = _build(spec["size"])
    ckpts = {m: _checkpoints(Path(spec["dir"]), m) for m in MODES}
    steps = dict.fromkeys(MODES, 0)

    def block(mode: str, n: int) -> dict[str, Any]:
        ckpt, memory = ckpts[mode], ckpts[mode].checkpointer.memory
        taken, load = memory.facts["taken_total"], os.getloadavg()[0]
        cpu0, loop0, waits = time.process_time(), time.thread_time(), 0.0
        started = time.perf_counter()
        for _ in range(n):
            train_step()
            steps[mode] += 1
            before = time.perf_counter()
            ckpt.maybe_save(steps[mode], model=model, optimizer=opt)
            waits += time.perf_counter() - before
        wall = time.perf_counter() - started
        memory.wait()
        return {"step": wall / n, "wait": waits / n,
                "snapshots": memory.facts["taken_total"] - taken,
                "other_cpu": (time.process_time() - cpu0) - (time.thread_time() - loop0),
                "every_steps": memory.facts["every_steps"], "load": load}

    for mode in MODES:  # warm-up: buffers allocated, auto's K measured; not counted
        block(mode, spec["warmup"])
    rounds: list[dict[str, Any]] = []
    for r in range(spec["rounds"]):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        rounds.append({m: block(m, spec["block"]) for m in order})
    out = {"size": spec["size"], "state_bytes": _state_bytes(model, opt), "rounds": rounds,
           "cadence": {m: ckpts[m].checkpointer.memory.facts["cadence"] for m in MODES}}
    for ckpt in ckpts.values():
        _close(ckpt)
    return out


def memory_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One process, one mode: ``steps`` steps; the rank's files in the tmpfs (the largest
    seen before and after each ``maybe_save``) and the process's resident set at the end
    and at its peak."""
    import torch

    torch.set_num_threads(1)
    model, opt, train_step = _build(spec["size"])
    ckpt = _checkpoints(Path(spec["dir"]), spec["mode"])
    memory = ckpt.checkpointer.memory
    root = memory.root if memory.enabled else None
    shm_max = 0
    for step in range(1, spec["steps"] + 1):
        train_step()
        shm_max = max(shm_max, _shm_bytes(root))  # the write of the step before is done
        ckpt.maybe_save(step, model=model, optimizer=opt)
        shm_max = max(shm_max, _shm_bytes(root))
    memory.wait()
    out = {"mode": spec["mode"], "size": spec["size"], "state_bytes": _state_bytes(model, opt),
           "snapshot_bytes": memory.facts["bytes"], "snapshots": memory.facts["taken_total"],
           "memory_bound_bytes": memory.facts["memory_bound_bytes"],
           "rss_end": _proc_status("VmRSS"), "rss_peak": _proc_status("VmHWM"),
           "shm_max": shm_max, "shm_end": _shm_bytes(root)}
    _close(ckpt)
    return out


# --------------------------------------------------------------------------- overhead

def _run_worker(kind: str, spec: dict[str, Any], inline: bool = False) -> dict[str, Any]:
    """A worker in its own process (``inline``: in this one, for ``--quick``)."""
    load = os.getloadavg()[0]
    if inline:
        out = WORKERS[kind](spec)
    else:
        done = subprocess.run([sys.executable, str(HERE), "--worker", kind, json.dumps(spec)],
                              capture_output=True, text=True, timeout=3600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if done.returncode != 0:
            raise SystemExit(f"{kind} worker {spec} failed ({done.returncode}):\n"
                             f"{done.stderr[-3000:]}")
        out = json.loads(done.stdout.strip().splitlines()[-1])
    out["load_average_1m"] = [load, os.getloadavg()[0]]
    return out


def _spread(values: list[float]) -> dict[str, Any]:
    """Median and min-max (NaN when there is nothing: e.g. no snapshot in a short block)."""
    if not values:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "each": []}
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "each": values}


def overhead(size: str, spec: dict[str, Any], repeats: int, inline: bool) -> dict[str, Any]:
    """``repeats`` processes of interleaved blocks; every ratio within a round."""
    runs = [_run_worker("time", {**spec, "size": size}, inline) for _ in range(repeats)]
    rounds = [r for run in runs for r in run["rounds"]]
    loads = [x["load"] for r in rounds for x in r.values()]
    out: dict[str, Any] = {
        "size": size, "state_bytes": runs[0]["state_bytes"], "processes": repeats, **spec,
        "load_average_1m": [min(loads + [x for run in runs for x in run["load_average_1m"]]),
                            max(loads + [x for run in runs for x in run["load_average_1m"]])],
        "off_step": _spread([r["off"]["step"] for r in rounds]), "runs": runs}
    for m in MODES[1:]:
        out[m] = {
            "step_ratio": _spread([r[m]["step"] / r["off"]["step"] for r in rounds]),
            "process_medians": [statistics.median(r[m]["step"] / r["off"]["step"]
                                                  for r in run["rounds"]) for run in runs],
            "wait_per_snapshot": _spread([(r[m]["wait"] - r["off"]["wait"]) * spec["block"]
                                          / r[m]["snapshots"] for r in rounds
                                          if r[m]["snapshots"]]),
            "writer_cpu_per_snapshot": _spread([
                (r[m]["other_cpu"] - r["off"]["other_cpu"]) / r[m]["snapshots"]
                for r in rounds if r[m]["snapshots"]]),
            "every_steps": sorted({r[m]["every_steps"] for r in rounds}),
            "cadence": [run["cadence"][m] for run in runs]}
    return out


def memory(size: str, steps: int, folder: Path, inline: bool) -> dict[str, Any]:
    """off then every_step, each its own process: what snapshots add to host memory."""
    runs = {m: _run_worker("memory", {"mode": m, "size": size, "steps": steps,
                                      "dir": str(folder)}, inline)
            for m in ("off", "every_step")}
    on, off = runs["every_step"], runs["off"]
    state = on["state_bytes"]
    return {"size": size, "state_bytes": state, "snapshot_bytes": on["snapshot_bytes"],
            "shm_max": on["shm_max"], "rss_over_off": on["rss_end"] - off["rss_end"],
            "peak_rss_over_off": on["rss_peak"] - off["rss_peak"],
            "bound_3x_state": 3 * state, "status_memory_bound": on["memory_bound_bytes"],
            "total_over_off": on["shm_max"] + on["rss_peak"] - off["rss_peak"],
            "load_average_1m": [min(off["load_average_1m"] + on["load_average_1m"]),
                                max(off["load_average_1m"] + on["load_average_1m"])],
            "runs": runs}


# --------------------------------------------------------------------------- recovery

def _wait(what: str, timeout: float, check: Callable[[], Any], every: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def _steps(path: Path) -> list[tuple[int, float]]:
    """(step index, end time) of every step rank 0 recorded."""
    out = []
    try:
        lines = path.read_bytes().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") == "step" and isinstance(rec.get("step"), int):
            out.append((rec["step"], float(rec["time"])))
    return out


def _killed_at(run: Any, restarted: float) -> float:
    """When rank 1 SIGKILLed itself: its ``fault_injected`` event, journaled just before the
    signal. (Rank 1's own metrics log is no clock for it: its lines are flushed once a
    heartbeat, so the last one that survived the SIGKILL precedes it by 0-1 s at random.)"""
    return max(e["time"] for e in run.events("fault_injected")
               if e.get("fault") == "kill" and e["time"] < restarted)


def recovery_one(folder: Path, mode: str, kill_at: int, timeout: float) -> dict[str, Any]:
    """One job: rank 1 SIGKILLs itself in step ``kill_at`` (the trainer's ``kill`` fault, as
    the OOM killer would); the restart timed from then to its first completed step."""
    from trainwatch.process.proctree import stop
    from trainwatch.rundir.run_dir import RunDir

    run = RunDir(folder / f"job-{mode}-{time.time_ns()}")
    log = open(folder / "jobs.log", "ab")
    load = os.getloadavg()[0]
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainwatch", "train", "--nproc-per-node", "2", str(run.root),
         "--steps", "1000000", "--max-restarts", "1", "--set", "checkpoint.every_steps=10",
         "--set", f"checkpoint.memory_snapshots={mode}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "TRAINWATCH_FAULT": f"kill:rank=1:step={kill_at}"})
    try:
        try:
            resumed = _wait("the resume", 300 + timeout,
                            lambda: run.events("checkpoint_resumed"), 0.1)[0]
        except TimeoutError as exc:
            tail = (folder / "jobs.log").read_bytes()[-2000:].decode(errors="replace")
            raise SystemExit(f"{mode}: {exc}; the job's output ends:\n{tail}") from None
        restarted = min(e["time"] for e in run.events("rank_started")
                        if e.get("restart_count", 0) >= 1)
        first = _wait("the first resumed step", timeout, lambda: [
            t for s, t in _steps(run.metrics_file(0)) if t > restarted], 0.1)[0]
        killed = _killed_at(run, restarted)
        completed = max(s for s, t in _steps(run.metrics_file(0)) if t < restarted) + 1
        return {"mode": mode, "kill_at": kill_at, "completed_before_kill": completed,
                "resumed_step": resumed["step"], "state_from": resumed.get("state_from"),
                "recomputed": completed - resumed["step"],
                "restart_seconds": round(restarted - killed, 2),
                "resume_seconds": round(first - restarted, 2),
                "first_step_seconds": round(first - killed, 2),
                "load_seconds": resumed.get("load_seconds"),
                "load_average_1m": [load, os.getloadavg()[0]]}
    finally:
        stop(proc, signal.SIGINT, grace=60)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()
        shutil.rmtree(run.root, ignore_errors=True)


RECOVERY_MODES = ("every_step", "auto", "off")


def recovery(repeats: int, folder: Path, timeout: float) -> dict[str, Any]:
    """Rounds of one job per mode (snapshots every step, auto, off: the durable checkpoint
    alone), the order rotating, the same kill step within a round."""
    rounds = []
    for r in range(repeats):
        kill_at = 21 + (r * 4) % 9  # steps 21, 25, 29, 24, ...: places in the interval
        order = RECOVERY_MODES[r % 3:] + RECOVERY_MODES[:r % 3]
        rounds.append({m: recovery_one(folder, m, kill_at, timeout) for m in order})
    out: dict[str, Any] = {"repeats": repeats, "rounds": rounds}
    for m in RECOVERY_MODES:
        out[m] = {k: _spread([p[m][k] for p in rounds])
                  for k in ("first_step_seconds", "restart_seconds", "resume_seconds",
                            "recomputed")}
        out[m]["state_from"] = sorted({str(p[m]["state_from"]) for p in rounds})
    for m in RECOVERY_MODES[:2]:
        for k in ("first_step", "resume"):
            out[f"{m}_over_off_{k}"] = _spread([
                p[m][f"{k}_seconds"] / p["off"][f"{k}_seconds"] for p in rounds])
    return out


# --------------------------------------------------------------------------- output

WORKERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "time": time_worker, "memory": memory_worker}


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def _line(label: str, s: dict[str, Any], fmt: str = "{:.3f}", scale: float = 1.0) -> str:
    return (f"    {label:40} {fmt.format(s['median'] * scale)} ({fmt.format(s['min'] * scale)}"
            f"–{fmt.format(s['max'] * scale)})")


def print_overhead(o: dict[str, Any]) -> None:
    print(f"\n{o['size']}: state {_mb(o['state_bytes'])}; {o['processes']} process(es) of "
          f"{o['rounds']} rounds of {o['block']}-step blocks per mode (+{o['warmup']} warm-up); "
          f"load average {o['load_average_1m'][0]:.1f}–{o['load_average_1m'][1]:.1f}")
    print(_line("off: step (ms)", o["off_step"], "{:.1f}", 1e3))
    for m in MODES[1:]:
        s = o[m]
        print(f"  {m}: K {s['every_steps']}; {s['cadence'][-1]}")
        print(_line("step time / off, per round", s["step_ratio"], "{:.3f}"))
        print(f"    {'medians per process':40} {', '.join(f'{x:.3f}' for x in s['process_medians'])}")
        print(_line("loop's wait per snapshot (ms)", s["wait_per_snapshot"], "{:.1f}", 1e3))
        print(_line("writer CPU per snapshot (ms)", s["writer_cpu_per_snapshot"], "{:.1f}", 1e3))


def print_memory(x: dict[str, Any]) -> None:
    print(f"\n{x['size']} memory (every_step against off): state {_mb(x['state_bytes'])}, "
          f"snapshot {_mb(x['snapshot_bytes'] or 0)}; /dev/shm at most {_mb(x['shm_max'])}; "
          f"RSS over off {_mb(x['rss_over_off'])} (peak {_mb(x['peak_rss_over_off'])}); "
          f"together {_mb(x['total_over_off'])} against 3 x state {_mb(x['bound_3x_state'])}; "
          f"load average {x['load_average_1m'][0]:.1f}–{x['load_average_1m'][1]:.1f}")


def print_recovery(r: dict[str, Any]) -> None:
    print(f"\nrecovery: trainwatch train, 2 ranks, checkpoint every 10 steps, rank 1 SIGKILLs "
          f"itself in the kill step; seconds from the kill; {r['repeats']} round(s)")
    for one in r["rounds"]:
        for m, x in one.items():
            print(f"  {m:10} killed in step {x['kill_at']}: {x['completed_before_kill']} steps done, "
                  f"resumed at {x['resumed_step']} from {x['state_from']} (recomputed "
                  f"{x['recomputed']}), restarted {x['restart_seconds']} s, first step "
                  f"{x['first_step_seconds']} s (restarted ranks' own "
                  f"{x['resume_seconds']} s); load {x['load_average_1m'][0]:.1f}–"
                  f"{x['load_average_1m'][1]:.1f}")
    for m in RECOVERY_MODES:
        print(_line(f"{m}: kill -> first step (s)", r[m]["first_step_seconds"], "{:.1f}"))
        print(_line(f"{m}: kill -> restarted (s)", r[m]["restart_seconds"], "{:.1f}"))
        print(_line(f"{m}: restarted -> first step (s)", r[m]["resume_seconds"], "{:.2f}"))
        print(_line(f"{m}: steps recomputed", r[m]["recomputed"], "{:.0f}"))
    for m in RECOVERY_MODES[:2]:
        print(_line(f"{m} / off: first step", r[f"{m}_over_off_first_step"], "{:.2f}"))
        print(_line(f"{m} / off: restarted -> first", r[f"{m}_over_off_resume"], "{:.2f}"))


BLOCKS = {"ref": {"block": 100, "rounds": 6, "warmup": 60},   # ~30 ms steps
          "large": {"block": 40, "rounds": 4, "warmup": 30}}   # ~0.3 s steps at 300 MB
QUICK = {"block": 5, "rounds": 1, "warmup": 5}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--parts", default="overhead,memory,recovery")
    parser.add_argument("--sizes", default="ref,300", help="ref and/or MB of state")
    parser.add_argument("--repeats", type=int, default=2,
                        help="processes per size (overhead), job pairs (recovery)")
    parser.add_argument("--block", type=int, help="steps per block (default: by size)")
    parser.add_argument("--rounds", type=int, help="rounds per process (default: by size)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run of seconds: ref, overhead and memory, in this process")
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(WORKERS[args.worker[0]](json.loads(args.worker[1]))))
        return 0
    if args.quick:
        args.sizes, args.repeats, args.parts = "ref", 1, "overhead,memory"
    report: dict[str, Any] = {"gpu": "not measured: no GPU run yet", "cpus": os.cpu_count(),
                              "overhead": [], "memory": []}
    with tempfile.TemporaryDirectory(prefix="tw-snap-bench-") as tmp:
        for size in args.sizes.split(","):
            spec = dict(QUICK if args.quick else BLOCKS["ref" if size == "ref" else "large"])
            spec.update({k: v for k, v in (("block", args.block), ("rounds", args.rounds))
                         if v is not None})
            spec["dir"] = tmp
            if "overhead" in args.parts:
                report["overhead"].append(overhead(size, spec, args.repeats, args.quick))
                if not args.json:
                    print_overhead(report["overhead"][-1])
            if "memory" in args.parts:
                report["memory"].append(memory(size, 3 if args.quick else 12, Path(tmp),
                                               args.quick))
                if not args.json:
                    print_memory(report["memory"][-1])
        if "recovery" in args.parts:
            report["recovery"] = recovery(args.repeats, Path(tmp), args.timeout)
            if not args.json:
                print_recovery(report["recovery"])
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"\nGPU path (pinned buffers, side stream): {report['gpu']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
