"""One rank of a rehearsal: the reference trainer's own pieces, a few steps, measured.

    torchrun --nproc-per-node N -m trainwatch.rehearse.worker --run-dir RUN --out OUT
             --checkpoint-dir DIR [--config FILE] [--set KEY=VALUE ...] [--steps K]

Every rank reports its versions and config digest, times an all-reduce, then trains
the configured model on ONE batch for K steps at the configured peak learning rate (a
model that cannot over-fit one batch will not learn from many; a warmup would hide a
dead optimizer), checking each step's loss and gradient norm on every rank. Then the
checkpoint round trip: save with the trainer's Checkpointer, load into fresh state,
save again, and compare the weights and optimizer digests. Each rank writes
``OUT/rank-NNNNN.json`` (what it saw, or the error that stopped it); the parent judges.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainwatch import __version__
from trainwatch.checkpoint_format.dcp import METADATA as DCP_METADATA
from trainwatch.contract.layout import rank_file_name
from trainwatch.rehearse.memory import PeakMemory
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.atomic import atomic_write_json

LATENCY_ROUNDS, BANDWIDTH_ROUNDS, BANDWIDTH_BYTES = 20, 5, 4 << 20


def versions(cfg: Any, probe_only: bool = False) -> dict[str, str]:
    nccl = ""
    if torch.cuda.is_available() and dist.is_nccl_available():
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return {"torch": str(torch.__version__), "cuda": torch.version.cuda or "", "nccl": nccl,
            "python": platform.python_version(), "trainwatch": __version__,
            **({} if probe_only else {"config_digest": cfg.digest()})}


def allreduce_probe(device: torch.device, world: int) -> dict[str, float] | None:
    """Median latency of a one-element all-reduce; bus bandwidth of a 4 MiB one."""
    if world < 2:
        return None
    small = torch.zeros(1, device=device)
    times = []
    for _ in range(LATENCY_ROUNDS):
        started = time.perf_counter()
        dist.all_reduce(small)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    big = torch.ones(BANDWIDTH_BYTES // 4, device=device)
    dist.all_reduce(big)  # warm-up: buffers, connections
    dist.barrier()
    started = time.perf_counter()
    for _ in range(BANDWIDTH_ROUNDS):
        dist.all_reduce(big)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - started) / BANDWIDTH_ROUNDS
    # bus bandwidth: what each rank moves in a ring all-reduce, per second (nccl-tests' busbw)
    return {"latency_seconds": sorted(times)[len(times) // 2],
            "bus_bytes_per_second": 2 * (world - 1) / world * BANDWIDTH_BYTES / seconds}


def tree_digest(tree: Any) -> str:
    """One hash of every tensor and plain value in a state tree, keys sorted."""
    digest = hashlib.sha256()

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().to("cpu").contiguous()
            digest.update(f"{path}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            for key in sorted(obj, key=str):
                walk(obj[key], f"{path}/{key}")
        elif isinstance(obj, (list, tuple)):
            for i, item in enumerate(obj):
                walk(item, f"{path}/{i}")
        else:
            digest.update(f"{path}={obj!r}\0".encode())

    walk(tree, "")
    return digest.hexdigest()


def checkpoint_digests(directory: Path) -> dict[str, str]:
    """Digests of a checkpoint's model, optimizer and scheduler: its ``.pt`` files, or the
    whole state a DCP checkpoint (``parallel.mode: fsdp``) holds across its shard files."""
    if (directory / DCP_METADATA).exists():
        state = dcp_state(directory)
        return {name: tree_digest(state.get(name)) for name in ("model", "optimizer",
                                                                 "scheduler")}
    return {name: tree_digest(torch.load(directory / f"{name}.pt", map_location="cpu",
                                         weights_only=True))
            for name in ("model", "optimizer", "scheduler")}


def dcp_state(directory: Path) -> dict[str, Any]:
    """Everything a DCP checkpoint holds, gathered whole in this process (no process group:
    DCP's own converter to one ``torch.save`` file, read back)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "whole.pt"
        dcp_to_torch_save(str(directory), str(whole))
        return torch.load(whole, map_location="cpu", weights_only=True)


def overfit(cfg: Any, state: Any, ddp: Any, ranks: Any, tel: Any, steps: int
            ) -> dict[str, Any]:
    """K steps on one batch at the peak learning rate; every rank's loss and grad norm."""
    from trainwatch.trainer.parallel import global_norm
    from trainwatch.trainer.train import autocast

    x, y = (t.to(ranks.device) for t in next(state.loader))
    for group in state.optimizer.param_groups:
        group["lr"] = cfg.optim.lr
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    losses, norms = [], []
    for step in range(steps):
        with tel.step(step) as record:
            with tel.phase("forward"), autocast(ranks.device):
                _, loss = ddp(x, y)
            with tel.phase("backward"):
                loss.backward()
            with tel.phase("optimizer"):
                norm = global_norm(torch.nn.utils.clip_grad_norm_(state.model.parameters(),
                                                                  clip))
                state.optimizer.step()
                state.optimizer.zero_grad(set_to_none=True)
            record.record(loss=loss.detach(), grad_norm=norm, lr=cfg.optim.lr,
                          tokens=x.numel(), samples=x.shape[0])
        losses.append(float(loss.detach().float().item()))
        norms.append(float(norm.float().item()))
    state.step = steps
    return {"losses": losses, "grad_norms": norms}


def round_trip(cfg: Any, run: RunDir, folder: Path, state: Any, data: Any, ranks: Any,
               tel: Any) -> dict[str, Any]:
    """Save -> load into fresh state -> save again with the trainer's Checkpointer."""
    import dataclasses

    from trainwatch.rank.checkpoint import Checkpointer
    from trainwatch.trainer.train import build_training_state, checkpoint_state, \
        restore_checkpoint

    saves: list[dict[str, Any]] = []
    out: dict[str, Any] = {"saves": saves}
    for name, source in (("first", state), ("second", None)):
        ck_cfg = dataclasses.replace(cfg.checkpoint, enabled=True, dir=str(folder / name),
                                     mirror_dir=None, resume="auto",
                                     keep_last=1, keep_best=0, every_steps=0)
        ckpt = Checkpointer(ck_cfg, run.root, telemetry=tel, config_hash=cfg.training_digest())
        if source is None:  # load what the first save wrote, into freshly built state
            source = build_training_state(cfg, data, ranks)
            loader = Checkpointer(dataclasses.replace(ck_cfg, dir=str(folder / "first")),
                                  run.root, config_hash=cfg.training_digest())
            restored = loader.resume()
            if restored is None:
                out["error"] = "the first save left nothing that verifies to load"
                return out
            restore_checkpoint(source, restored, loader.group)
            restored.restore_rng()
        started = time.perf_counter()
        ckpt.after_step(source.step, lambda s=source: checkpoint_state(s), final=True)
        ckpt.close()
        saves.append({"seconds": time.perf_counter() - started, **{
            k: ckpt.facts.get(k) for k in ("ok", "bytes", "last_error", "path")}})
    if ranks.rank == 0 and all(s["ok"] for s in saves):
        out["digests"] = [checkpoint_digests(Path(s["path"])) for s in saves]
        out["files_bytes"] = sum(f.stat().st_size for f in Path(saves[0]["path"]).iterdir())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainwatch.rehearse.worker")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--config")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--probe-only", action="store_true",
                        help="versions and the all-reduce probe only (for a user's command)")
    args = parser.parse_args(argv)

    from trainwatch.trainer.config import load_config
    from trainwatch.rank.telemetry import Telemetry
    from trainwatch.trainer.train import (Ranks, build_training_state, open_data,
                                          setup_process_group)

    rank = int(os.environ.get("RANK", "0"))
    result: dict[str, Any] = {"rank": rank}
    out = Path(args.out) / rank_file_name(rank, ".json")
    stage = "config"
    try:
        cfg = load_config(args.config, args.overrides)
        stage = "process group"
        ranks: Ranks = setup_process_group(cfg)
        run = RunDir(args.run_dir).create()
        result["versions"] = versions(cfg, args.probe_only)
        if ranks.distributed:
            gathered: list[Any] = [None] * ranks.world_size
            dist.all_gather_object(gathered, result["versions"])
            result["all_versions"] = gathered
        stage = "all-reduce"
        result["allreduce"] = allreduce_probe(ranks.device, ranks.world_size)
        if args.probe_only:
            if ranks.distributed:
                dist.destroy_process_group()
            atomic_write_json(out, result)
            return 0
        stage = "data"
        data = open_data(cfg, run, ranks)
        tel = Telemetry.from_env(run.root, heartbeat_interval=0.5, device=ranks.device,
                                 exchange_every=0)
        tel.start()
        tel.set_info(config_digest=cfg.digest(), rehearsal=True)
        stage = "warm-up"
        if ranks.device.type == "cpu":  # page in every lazy import before the baseline
            import dataclasses
            small = dataclasses.replace(cfg, model=dataclasses.replace(
                cfg.model, layers=1, width=cfg.model.heads * 8, context=8))
            warm = build_training_state(small, data, ranks)
            overfit(small, warm, warm.model, ranks, _Quiet(), 1)
            del warm
        stage = "build"
        probe = PeakMemory(ranks.device)
        state = build_training_state(cfg, data, ranks)
        from trainwatch.trainer.parallel import wrap
        ddp = wrap(state.model, cfg.parallel.mode, ranks.device, ranks.distributed)
        stage = "forward/backward/step"
        result["overfit"] = overfit(cfg, state, ddp, ranks, tel, args.steps)
        result["memory"] = {"peak_bytes": probe.peak_bytes(), "kind": probe.kind}
        stage = "checkpoint"
        result["checkpoint"] = round_trip(cfg, run, Path(args.checkpoint_dir), state, data,
                                          ranks, tel)
        tel.close("finished")
        if ranks.distributed:
            dist.barrier()
            dist.destroy_process_group()
    except BaseException as exc:  # the parent reports it; the other ranks are stopped by torchrun
        result["error"] = {"stage": stage, "message": f"{type(exc).__name__}: {exc}",
                           "traceback": traceback.format_exc(limit=6)}
        atomic_write_json(out, result)
        print(f"rehearsal rank {rank}: {stage} failed: {exc}", file=sys.stderr)
        return 1
    atomic_write_json(out, result)
    return 0


class _Quiet:
    """Telemetry's step/phase interface that records nothing (the warm-up is not the run)."""

    class _Step:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def record(self, **values):
            pass

    def step(self, step):
        return self._Step()

    def phase(self, name):
        return self._Step()


if __name__ == "__main__":
    sys.exit(main())
