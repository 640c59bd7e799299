"""``trainwatch train`` and ``trainwatch data``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from trainwatch.config.clitypes import MAX_RESTARTS, NPROC_PER_NODE, run_dir_option
from trainwatch.contract.env import NODE_ENV
from trainwatch.contract.ports import LOOPBACK

if TYPE_CHECKING:
    from trainwatch.rundir.run_dir import RunDir


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--nproc-per-node", type=NPROC_PER_NODE, default=1, show_default=True,
              help="Ranks on this machine.")
@run_dir_option("Where the run keeps its state (status, metrics, journal, logs); or give it "
                "as RUN_DIR.", argument=True, required=True)
@click.option("--steps", type=click.IntRange(min=1), help="Shorthand for --set train.steps=N.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help="YAML config (sections model, data, optim, train, telemetry, checkpoint).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override one config key, e.g. --set optim.lr=1e-3 (repeatable).")
@click.option("--max-restarts", type=int, default=MAX_RESTARTS, show_default=True,
              help="Times torchrun restarts all ranks after a rank fails.")
@click.option("--nnodes", type=int, default=1, show_default=True,
              help="Machines in the job (each runs this command).")
@click.option("--min-nnodes", type=int,
              help="Go on with as few as this many machines when others are lost, resuming "
                   "at the smaller world size, and grow back when they return (torchrun "
                   "--nnodes MIN:MAX; docs/deploy.md, 'A lost node'). Default: --nnodes (the "
                   "others wait for a replacement).")
@click.option("--node-rank", type=int,
              help="This machine's index (multi-node); node 0 hosts the rendezvous store, so "
                   "run it where --rdzv-endpoint points. Global ranks follow the rendezvous.")
@click.option("--rdzv-endpoint", metavar="HOST:PORT",
              help="torchrun c10d rendezvous endpoint (multi-node).")
@click.option("--rdzv-id", help="Rendezvous id shared by all nodes (default: the job name).")
@click.option("--local-addr", metavar="ADDR",
              help="Address the other nodes reach this one at (torchrun --local-addr; "
                   "default: the FQDN). Rank 0's node serves MASTER_ADDR on it.")
@click.option("--node-name", metavar="NAME",
              help="Node name in the ranks' status and the journal; must match the node's "
                   f"agent (default: ${NODE_ENV}, else the hostname).")
@click.option("--metrics-port", type=int,
              help=f"Ranks serve Prometheus metrics on {LOOPBACK}:(PORT + local rank) "
                   "(shorthand for --set telemetry.metrics_port=PORT).")
def train(run: RunDir, nproc_per_node: int, steps: int | None, config_file: str | None,
          overrides: tuple[str, ...], max_restarts: int, nnodes: int, min_nnodes: int | None,
          node_rank: int | None,
          rdzv_endpoint: str | None, rdzv_id: str | None, local_addr: str | None,
          node_name: str | None, metrics_port: int | None) -> None:
    """Run the reference trainer under torchrun, restarting failed ranks.

    The config is validated first (a bad key exits 2 before anything starts).
    Fault drills: set TRAINWATCH_FAULT (docs/trainer.md), e.g.
    TRAINWATCH_FAULT=exit:rank=1:step=5.
    """
    from trainwatch.trainer.launcher import LaunchSpec, launch

    spec = LaunchSpec(run_dir=run.root, nproc_per_node=nproc_per_node, config=config_file,
                      overrides=[*overrides,
                                 *([f"train.steps={steps}"] if steps is not None else []),
                                 *([f"telemetry.metrics_port={metrics_port}"]
                                   if metrics_port is not None else [])],
                      max_restarts=max_restarts, nnodes=nnodes, min_nnodes=min_nnodes,
                      node_rank=node_rank,
                      rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, local_addr=local_addr,
                      node_name=node_name)
    sys.exit(launch(spec))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def data() -> None:
    """Prepare and inspect byte-level token datasets."""


@data.command()
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory to write train.bin, val.bin and manifest.json into.")
@click.option("--from-text", type=click.Path(dir_okay=False, path_type=Path),
              help="Tokenize this text file instead of generating the built-in corpus.")
@click.option("--bytes", "size_bytes", type=click.IntRange(min=1000), default=1_000_000,
              show_default=True, help="Size of the generated corpus.")
@click.option("--seed", type=int, default=1234, show_default=True,
              help="Seed of the generated corpus.")
@click.option("--val-fraction", type=float, default=0.1, show_default=True,
              help="Share of the tokens held out for validation.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def prepare(out: Path, from_text: Path | None, size_bytes: int, seed: int, val_fraction: float,
            as_json: bool) -> None:
    """Write a dataset (token files plus a checksummed manifest) the trainer can use
    with --set data.path=DIR."""
    from trainwatch.trainer.data import manifest_summary, prepare_generated, prepare_text

    if from_text is not None:
        manifest = prepare_text(out, from_text, val_fraction=val_fraction)
    else:
        manifest = prepare_generated(out, size_bytes=size_bytes, seed=seed,
                                     val_fraction=val_fraction)
    if as_json:
        click.echo(json.dumps(manifest, indent=2))
    else:
        click.echo(f"prepared {out}: {manifest_summary(manifest)}")


@data.command()
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def info(directory: Path, as_json: bool) -> None:
    """Show a prepared dataset and verify its checksums (exit 2 if they do not match)."""
    from trainwatch.trainer.data import describe, manifest_summary

    described = describe(directory)
    if as_json:
        click.echo(json.dumps(described, indent=2))
    else:
        click.echo(f"{described['path']}: verified; {manifest_summary(described)}")
