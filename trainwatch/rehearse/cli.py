"""``trainwatch rehearse``: a short real run of a configuration, PASS / WARN / FAIL per check."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import click

from trainwatch.config.clitypes import NPROC_PER_NODE, run_dir_option, seconds
from trainwatch.contract.env import RECEIVER_TOKEN_ENV as TOKEN_ENV
from trainwatch.errors import EXIT_PROBLEM, ConfigError

FORMAT = "trainwatch.rehearsal"
MARK = {"PASS": "PASS", "WARN": "WARN", "FAIL": "FAIL", "SKIP": "skip"}


def _token(token_file: str | None) -> str | None:
    if token_file is None:
        return os.environ.get(TOKEN_ENV) or None
    try:
        return Path(token_file).read_text().strip() or None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the token: {getattr(exc, 'strerror', None) or exc}",
                          file=token_file, key="--token-file") from None


def _plan(cfg, source: str, nproc: int, write_gbps: float | None) -> dict:
    from trainwatch.plan.estimate import make_plan
    from trainwatch.plan.spec import from_trainer_config

    cuda = cfg.train.device == "cuda"
    if cfg.train.device == "auto":
        import torch
        cuda = torch.cuda.is_available()
    spec = from_trainer_config(cfg, source, devices=nproc, device_type="h100" if cuda else "cpu")
    if write_gbps is not None:
        spec.write_bytes_per_second = write_gbps * 1e9
    return make_plan(spec.validate())


@click.command("rehearse")
@click.option("--config", type=click.Path(dir_okay=False),
              help="The reference trainer's YAML config to rehearse (default: its defaults).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override one trainer config key (repeatable).")
@click.option("--nproc-per-node", "nproc", type=NPROC_PER_NODE, default=2, show_default=True,
              help="Ranks on this machine.")
@run_dir_option("Where the rehearsal's run directory goes (default: a new temporary one).")
@click.option("--steps", type=int, default=12, show_default=True,
              help="Steps of over-fitting one batch.")
@click.option("--webhook", multiple=True, metavar="URL",
              help="Alert receiver (Alertmanager webhook format) to send a test alert to.")
@click.option("--alertmanager", metavar="URL", help="Alertmanager to send a test alert to.")
@click.option("--token-file", type=click.Path(dir_okay=False),
              help=f"Bearer token for --webhook (default: ${TOKEN_ENV}).")
@click.option("--min-allreduce-mbps", type=float, default=10.0, show_default=True,
              help="All-reduce bus bandwidth floor in MB/s.")
@click.option("--max-allreduce-latency-ms", type=float, default=250.0, show_default=True,
              help="All-reduce latency ceiling in ms.")
@click.option("--write-gbps", type=float,
              help="Checkpoint write throughput plan assumes, GB/s (plan's default: 1).")
@click.option("--timeout", type=seconds(1), default=600.0, show_default=True,
              help="Seconds the ranks (or the command) may take.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def rehearse(config, overrides, nproc, run, steps, webhook, alertmanager, token_file,
             min_allreduce_mbps, max_allreduce_latency_ms, write_gbps, timeout, as_json,
             command) -> None:
    """Rehearse a run small before running it big: versions on every rank, forward,
    backward and step, loss falling on one batch, checkpoint save -> load -> save, all-reduce, telemetry
    to the agent, a test alert to the receiver, checkpoint storage, plan's estimates.

    After `--`, a COMMAND (your own trainer, instrumented with trainwatch telemetry) is run
    instead of the reference trainer. Exit 1 when a check fails.
    """
    from trainwatch.rehearse.checks import overall
    from trainwatch.rehearse.runner import Settings, rehearse as run_rehearsal

    if nproc < 1:
        raise ConfigError(f"must be at least 1, got {nproc}", key="--nproc-per-node")
    if steps < 2:
        raise ConfigError(f"must be at least 2, got {steps}", key="--steps")
    cfg = plan = None
    if not command or config or overrides:
        from trainwatch.trainer.config import load_config
        cfg = load_config(config, overrides)  # bad config: exit 2 before anything runs
        plan = _plan(cfg, config or "reference trainer defaults", nproc, write_gbps)
    settings = Settings(
        run_dir=run.root if run else Path(tempfile.mkdtemp(prefix="trainwatch-rehearse-")),
        nproc=nproc, config=config, overrides=list(overrides), steps=steps,
        command=list(command), webhooks=list(webhook), alertmanager=alertmanager,
        token=_token(token_file), min_bus_bytes_per_second=min_allreduce_mbps * 1e6,
        max_latency_seconds=max_allreduce_latency_ms / 1e3, timeout=timeout)
    report = run_rehearsal(settings, cfg if not command else None, plan if not command else None)
    verdict = overall(report["checks"])
    if as_json:
        click.echo(json.dumps({"format": FORMAT, "version": 1, "verdict": verdict,
                               **report, "checks": [c.as_dict() for c in report["checks"]]},
                              indent=1, default=str))
    else:
        for c in report["checks"]:
            click.echo(f"{MARK[c.status]:<5} {c.id:<22} {c.reason}")
        for item in report["remains"]:
            click.echo(f"{'-':<5} {'not checked':<22} {item}")
        click.echo(f"\nrehearsal {verdict}; run directory {report['run_dir']}")
    if verdict == "FAIL":
        sys.exit(EXIT_PROBLEM)
