"""Run a rehearsal: probe storage and the alert receiver, start the agent, run the ranks,
then judge what they reported against plan's estimates and fixed floors."""

from __future__ import annotations

import math
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainwatch.contract.env import FAULT_ENV, REHEARSAL_ENV, RUN_DIR_ENV
from trainwatch.contract.layout import (REHEARSAL_AGENT_LOG, REHEARSAL_DIR, REHEARSAL_LOG,
                                        REHEARSAL_PROBE_LOG, REHEARSAL_SCRATCH_PREFIX,
                                        STATUS_FILE_GLOB)
from trainwatch.contract.ports import LOOPBACK
from trainwatch.errors import ConfigError
from trainwatch.rehearse.checks import Check
from trainwatch.rehearse.memory import MALLOC_ENV
from trainwatch.rehearse import probes
from trainwatch.rundir.run_dir import RunDir
from trainwatch.rundir.runlock import hold
from trainwatch.trainer.rendezvous import one_node_args, pin_standalone

LOSS_DROP = 0.01            # the over-fit loss must fall by at least 1 %
CHECKPOINT_TOLERANCE = 0.05  # plan's checkpoint size vs the real one: WARN beyond 5 %
MEMORY_LOW, MEMORY_HIGH, MEMORY_SLACK = 0.75, 1.05, 32 << 20  # + process noise on small models
AGENT_WAIT_SECONDS = 30.0


@dataclass
class Settings:
    run_dir: Path
    nproc: int = 2
    config: str | None = None
    overrides: list[str] = field(default_factory=list)
    steps: int = 12
    command: list[str] = field(default_factory=list)
    webhooks: list[str] = field(default_factory=list)
    alertmanager: str | None = None
    token: str | None = None
    min_bus_bytes_per_second: float = 10e6
    max_latency_seconds: float = 0.25
    write_bytes_per_second: float | None = None
    timeout: float = 600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def start_agent(run: RunDir) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    log = open(run.logs_dir / REHEARSAL_AGENT_LOG, "ab")
    proc = subprocess.Popen([sys.executable, "-m", "trainwatch", "agent", "--run-dir",
                             str(run.root), "--listen", f"{LOOPBACK}:{port}"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    log.close()
    return proc, f"http://{LOOPBACK}:{port}"


def job_env(run: RunDir, nproc: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({RUN_DIR_ENV: str(run.root.resolve()), REHEARSAL_ENV: "1",
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TMPDIR": str(run.tmp_dir.resolve()),
                **MALLOC_ENV})
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env.pop(FAULT_ENV, None)
    return env


def run_job(cmd: list[str], env: dict[str, str], log_path: Path, timeout: float
            ) -> tuple[int | None, str]:
    """The command's exit code (None: timed out, stopped) and the end of its output."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            from trainwatch.process.proctree import stop
            stop(proc)
            code = None
    tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
    return code, "\n".join(tail)


# ------------------------------------------------------------------------------- checks

def storage_checks(probe: dict[str, Any], plan: dict[str, Any] | None) -> list[Check]:
    need = plan["storage"]["checkpoints_bytes"] if plan else None
    assumed = plan["storage"]["write_bytes_per_second"] if plan else None
    checks = []
    free = probe.get("free_bytes")
    if free is None:
        checks.append(Check("storage.space", "FAIL", f"{probe['path']}: {probe.get('error')}",
                            probe))
    elif need is not None and free < need:
        checks.append(Check("storage.space", "FAIL",
                            f"{probe['path']}: {free / 1e6:,.1f} MB free, the run's checkpoints "
                            f"need {need / 1e6:,.1f} MB (plan: kept + 1 copies)", probe))
    else:
        checks.append(Check("storage.space", "PASS", f"{probe['path']}: {free / 1e6:,.1f} MB "
                            "free" + (f", checkpoints need {need / 1e6:,.1f} MB" if need else ""),
                            probe))
    if probe.get("skipped"):
        checks.append(Check("storage.throughput", "SKIP", f"not measured: {probe['skipped']}",
                            probe))
    elif probe.get("error") and free is not None:
        checks.append(Check("storage.throughput", "FAIL", f"writing {probe['probe_bytes']} B "
                            f"to the checkpoint directory failed: {probe['error']}", probe))
    elif probe.get("write_bytes_per_second"):
        write, read = probe["write_bytes_per_second"], probe["read_bytes_per_second"]
        text = f"write {write / 1e6:,.0f} MB/s (fsync), read {read / 1e6:,.0f} MB/s"
        if assumed and write < assumed:
            checks.append(Check("storage.throughput", "WARN", f"{text}: below the "
                                f"{assumed / 1e6:,.0f} MB/s plan assumed (saves take longer; "
                                "plan --write-gbps)", probe))
        else:
            checks.append(Check("storage.throughput", "PASS", text, probe))
    return checks


def version_check(results: dict[int, dict[str, Any]]) -> Check:
    reported: dict[int, dict[str, Any]] = {r: res["versions"] for r, res in results.items()
                                           if res.get("versions")}
    if not reported:
        return Check("versions", "SKIP", "no rank got far enough to report its versions")
    base = reported[min(reported)]
    differ = []
    for rank, v in sorted(reported.items()):
        for key, value in v.items():
            if value != base.get(key):
                differ.append(f"rank {rank} {key} {value!r} (rank {min(reported)}: "
                              f"{base.get(key)!r})")
    if differ:
        return Check("versions", "FAIL", "ranks differ: " + "; ".join(differ), {"ranks": reported})
    shown = ", ".join(f"{k} {v}" for k, v in base.items() if v)
    return Check("versions", "PASS", f"{len(reported)} rank(s) agree: {shown}",
                 {"ranks": reported})


def step_checks(results: dict[int, dict[str, Any]], steps: int) -> list[Check]:
    errors = {r: res["error"] for r, res in results.items() if res.get("error")}
    early = {r: e for r, e in errors.items() if e["stage"] not in ("checkpoint",)}
    if early:
        rank, err = min(early.items())
        return [Check("steps", "FAIL", f"rank {rank}: {err['stage']} failed: {err['message']}",
                      {"errors": errors}),
                Check("loss_falls", "SKIP", "the steps did not run")]
    runs = {r: res["overfit"] for r, res in results.items() if res.get("overfit")}
    if not runs:
        return [Check("steps", "FAIL", "no rank reported its steps (see the job log)"),
                Check("loss_falls", "SKIP", "the steps did not run")]
    bad = [f"rank {r} step {i}" for r, o in sorted(runs.items())
           for i, (loss, norm) in enumerate(zip(o["losses"], o["grad_norms"]))
           if not (math.isfinite(loss) and math.isfinite(norm))]
    checks = []
    if bad:
        checks.append(Check("steps", "FAIL", "non-finite loss or gradient norm at "
                            + ", ".join(bad[:5]), {"overfit": runs}))
    else:
        checks.append(Check("steps", "PASS", f"forward, backward and optimizer step ran {steps} "
                            f"times on {len(runs)} rank(s); losses and gradient norms finite"))
    losses = runs[min(runs)]["losses"]
    first, last = losses[0], losses[-1]
    evidence = {"losses": losses}
    if not (math.isfinite(first) and math.isfinite(last)) or last > first * (1 - LOSS_DROP):
        checks.append(Check("loss_falls", "FAIL", f"the loss did not fall over-fitting one batch:"
                            f" {first:.4f} -> {last:.4f} in {len(losses)} steps at the peak "
                            "learning rate (learning rate, optimizer, gradients reaching the "
                            "weights?)", evidence))
    else:
        checks.append(Check("loss_falls", "PASS", f"over-fitting one batch: {first:.4f} -> "
                            f"{last:.4f} in {len(losses)} steps", evidence))
    return checks


def checkpoint_check(results: dict[int, dict[str, Any]]) -> Check:
    main = results.get(0, {})
    if main.get("error") and main["error"]["stage"] == "checkpoint":
        return Check("checkpoint_round_trip", "FAIL",
                     f"rank 0: checkpoint failed: {main['error']['message']}", main["error"])
    ck = main.get("checkpoint")
    if not ck:
        return Check("checkpoint_round_trip", "SKIP", "not reached")
    failed = [s for s in ck.get("saves", []) if not s.get("ok")]
    if failed:
        return Check("checkpoint_round_trip", "FAIL", f"save failed: {failed[0].get('last_error')}",
                     ck)
    if ck.get("error"):
        return Check("checkpoint_round_trip", "FAIL", ck["error"], ck)
    first, second = ck["digests"]
    differ = sorted(k for k in first if first[k] != second.get(k))
    if differ:
        return Check("checkpoint_round_trip", "FAIL", "save -> load -> save changed "
                     + ", ".join(differ), ck)
    return Check("checkpoint_round_trip", "PASS", f"save -> load -> save: same digests of "
                 f"model, optimizer and scheduler ({ck['files_bytes'] / 1e6:,.2f} MB, "
                 f"saved in {ck['saves'][0]['seconds']:.2f} s)", ck)


def allreduce_check(results: dict[int, dict[str, Any]], s: Settings) -> Check:
    probe = results.get(0, {}).get("allreduce")
    if s.nproc < 2:
        return Check("allreduce", "SKIP", "one rank: nothing to all-reduce with")
    if not probe:
        return Check("allreduce", "FAIL", "the probe did not run (see the job log)")
    bw, lat = probe["bus_bytes_per_second"], probe["latency_seconds"]
    text = (f"bus bandwidth {bw / 1e6:,.1f} MB/s (floor {s.min_bus_bytes_per_second / 1e6:,.1f}),"
            f" latency {lat * 1e3:.2f} ms (ceiling {s.max_latency_seconds * 1e3:.0f})")
    bad = bw < s.min_bus_bytes_per_second or lat > s.max_latency_seconds
    return Check("allreduce", "FAIL" if bad else "PASS", text, probe)


def plan_checks(results: dict[int, dict[str, Any]], plan: dict[str, Any]) -> list[Check]:
    checks = []
    measured = [res["memory"]["peak_bytes"] for res in results.values()
                if res.get("memory") and res["memory"]["peak_bytes"] is not None]
    estimate = plan["memory"]["total_bytes"]
    if not measured:
        checks.append(Check("plan.memory", "SKIP", "no rank measured its peak memory"))
    elif MEMORY_SLACK >= (MEMORY_HIGH - MEMORY_LOW) * estimate:
        # The process noise allowed for is wider than the whole tolerance band: a PASS here
        # would say nothing (and nothing could fail). Rehearse the real model size.
        peak = max(measured)
        checks.append(Check("plan.memory", "SKIP",
                            f"the model is too small to judge plan's memory: plan "
                            f"{estimate / 1e6:,.1f} MB, measured {peak / 1e6:,.1f} MB (ratio "
                            f"{peak / estimate:.2f}), within process noise "
                            f"({MEMORY_SLACK >> 20} MiB); rehearse the real model size",
                            {"measured": measured, "estimate": estimate}))
    else:
        peak = max(measured)
        ok = MEMORY_LOW * estimate - MEMORY_SLACK <= peak <= MEMORY_HIGH * estimate + MEMORY_SLACK
        text = (f"measured peak {peak / 1e6:,.1f} MB per rank, plan {estimate / 1e6:,.1f} MB "
                f"(ratio {peak / estimate:.2f}; expected {MEMORY_LOW}-{MEMORY_HIGH} or within "
                f"{MEMORY_SLACK >> 20} MiB)")
        checks.append(Check("plan.memory", "PASS" if ok else "WARN", text,
                            {"measured": measured, "estimate": estimate,
                             "kind": results[min(results)].get("memory", {}).get("kind")}))
    ck = results.get(0, {}).get("checkpoint") or {}
    real, est = ck.get("files_bytes"), plan["storage"]["checkpoint_bytes"]
    if not real:
        checks.append(Check("plan.checkpoint_bytes", "SKIP", "no checkpoint was written"))
    else:
        off = abs(real - est) / real
        checks.append(Check("plan.checkpoint_bytes",
                            "PASS" if off <= CHECKPOINT_TOLERANCE else "WARN",
                            f"checkpoint {real:,} B, plan {est:,.0f} B ({off:.2%} off)",
                            {"measured": real, "estimate": est}))
    return checks


def alert_checks(s: Settings, run_name: str) -> list[Check]:
    targets = [(url, False) for url in s.webhooks]
    if s.alertmanager:
        targets.append((s.alertmanager, True))
    if not targets:
        return [Check("alert_receiver", "WARN", "no alert receiver configured (--webhook, "
                      "--alertmanager): nobody would hear an alert")]
    checks = []
    for url, am in targets:
        reply = probes.send_test_alert(url, alertmanager=am, token=s.token, run=run_name)
        if reply.get("error"):
            checks.append(Check("alert_receiver", "FAIL", f"{reply['url']}: the test alert did "
                                f"not get through: {reply['error']}", reply))
        else:
            checks.append(Check("alert_receiver", "PASS", f"{reply['url']} accepted a firing "
                                "and a resolved test alert", reply))
    return checks


def telemetry_check(agent_url: str | None, agent_proc: subprocess.Popen | None, ranks: int,
                    steps: int) -> Check:
    if agent_proc is None or agent_url is None:
        return Check("telemetry", "FAIL", "the agent did not start")
    seen, error = probes.wait_for_agent_steps(agent_url, ranks, steps, AGENT_WAIT_SECONDS)
    if error and not seen:
        return Check("telemetry", "FAIL", f"the agent at {agent_url} did not answer: {error} "
                     f"(logs/{REHEARSAL_AGENT_LOG})")
    missing = [r for r in range(ranks) if seen.get(r, 0) < steps]
    if missing:
        return Check("telemetry", "FAIL", f"the agent at {agent_url} does not show {steps} "
                     f"steps for rank(s) {missing} (seen: {seen})", {"seen": seen})
    return Check("telemetry", "PASS", f"the agent at {agent_url} exports every rank's "
                 f"{steps} steps", {"seen": seen})


# --------------------------------------------------------------------------- the run

def rehearse(s: Settings, cfg: Any | None, plan: dict[str, Any] | None) -> dict[str, Any]:
    """Run everything; returns the report (checks, paths, what remains for a command)."""
    run = RunDir(s.run_dir)
    if run.run_file.exists() or (any(run.status_dir.glob(STATUS_FILE_GLOB))
                                 and not run.rehearsal_dir.is_dir()):
        # Another run's directory: the rehearsal's ranks would overwrite its status files.
        raise ConfigError("this is a training run's directory; give the rehearsal a new one",
                          file=str(run.root), key="--run-dir")
    lock = hold(run, "trainwatch rehearse")  # not beside a supervisor's job, nor a rehearsal's
    try:
        return _rehearse(s, run, cfg, plan)
    finally:
        lock.release()


def _rehearse(s: Settings, run: RunDir, cfg: Any | None,
              plan: dict[str, Any] | None) -> dict[str, Any]:
    from trainwatch.process.proctree import stop

    out = run.rehearsal_dir
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    if cfg is not None and cfg.checkpoint.dir:
        ck_folder = Path(cfg.checkpoint.dir)
    else:
        ck_folder = run.checkpoint_dir
    # The rehearsal's checkpoints live in a hidden folder next to the real ones: never a
    # `step-*` directory a real run could resume from; removed at the end.
    scratch = ck_folder / f"{REHEARSAL_SCRATCH_PREFIX}{os.getpid()}"
    checks: list[Check] = []
    ckpt_bytes = plan["storage"]["checkpoint_bytes"] if plan else 0.0
    need = plan["storage"]["checkpoints_bytes"] if plan else 0.0
    checks += storage_checks(probes.storage_probe(ck_folder, ckpt_bytes, need), plan)
    checks += alert_checks(s, run.root.name)
    agent_proc, agent_url = None, None
    remains: list[str] = []
    try:
        try:
            agent_proc, agent_url = start_agent(run)
        except OSError:
            agent_proc = None
        env = job_env(run, s.nproc)
        torchrun = [sys.executable, "-m", "torch.distributed.run",
                    *one_node_args(f"rehearsal-{os.getpid()}"), f"--nproc-per-node={s.nproc}", "--max-restarts=0",
                    f"--log-dir={run.logs_dir / REHEARSAL_DIR}", "--redirects=3", "--tee=3"]
        if not s.command:
            cmd = [*torchrun, "-m", "trainwatch.rehearse.worker", "--run-dir",
                   str(run.root.resolve()), "--out", str(out.resolve()), "--checkpoint-dir",
                   str(scratch.resolve()), "--steps", str(s.steps)]
            if s.config:
                cmd += ["--config", str(Path(s.config).resolve())]
            for o in s.overrides:
                cmd += ["--set", o]
            code, tail = run_job(cmd, env, run.logs_dir / REHEARSAL_LOG, s.timeout)
            results = _rank_results(out)
            checks.append(version_check(results))
            checks += step_checks(results, s.steps)
            if code is None:
                checks.append(Check("job", "FAIL", f"the rehearsal did not end within "
                                    f"{s.timeout:g} s", {"log_tail": tail}))
            elif code != 0 and not any(r.get("error") for r in results.values()):
                checks.append(Check("job", "FAIL", f"the ranks exited {code}", {"log_tail": tail}))
            checks.append(checkpoint_check(results))
            checks.append(allreduce_check(results, s))
            checks.append(telemetry_check(agent_url, agent_proc, s.nproc, s.steps))
            if plan is not None:
                checks += plan_checks(results, plan)
        else:
            from trainwatch.rehearse.command import command_checks
            probe = [*torchrun, "-m", "trainwatch.rehearse.worker", "--probe-only", "--run-dir",
                     str(run.root.resolve()), "--out", str(out.resolve()),
                     "--checkpoint-dir", str(scratch.resolve())]
            run_job(probe, env, run.logs_dir / REHEARSAL_PROBE_LOG, s.timeout)
            results = _rank_results(out)
            checks.append(version_check(results))
            checks.append(allreduce_check(results, s))
            started = time.time()
            pin_standalone(s.command, env)
            code, tail = run_job(s.command, env, run.logs_dir / REHEARSAL_LOG, s.timeout)
            more, remains = command_checks(run, code, tail, started, agent_url, agent_proc)
            checks += more
    finally:
        if agent_proc is not None:
            stop(agent_proc)
        shutil.rmtree(scratch, ignore_errors=True)
    return {"run_dir": str(run.root), "checkpoint_dir": str(ck_folder), "checks": checks,
            "remains": remains}


def _rank_results(out: Path) -> dict[int, dict[str, Any]]:
    import json
    results = {}
    for path in sorted(out.glob(STATUS_FILE_GLOB)):  # one per rank, named like status files
        try:
            data = json.loads(path.read_text())
            results[int(data["rank"])] = data
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return results
