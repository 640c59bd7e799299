"""``trainwatch run``: the agent, the embedded alert engine and a training job, together.

The embedded default on one machine: no Prometheus, no Alertmanager.  It starts
``trainwatch agent`` on the run directory, evaluates the alert rules against the
agent's /metrics, runs ``trainwatch train`` under the job controller (restarts,
rollbacks and the no-progress guard as the rules say), shows a live view, and stops
everything cleanly on Ctrl-C or when training ends.  The journal tells the story.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Iterator

import click
from rich.console import Console
from rich.live import Live
from rich.logging import RichHandler

from trainwatch.alerts.rules import load_rules
from trainwatch.config.clitypes import (MAX_RESTARTS, NPROC_PER_NODE, RUN_DIR_PATH, run_dir_option,
                                       seconds)
from trainwatch.contract.stall import RECORD_KEY as STALL_RECORD_KEY
from trainwatch.control.actions import Policy
from trainwatch.control.command import TELEMETRY_GRACE_SECONDS
from trainwatch.control.controller import train_command
from trainwatch.control.embedded_agent import free_port
from trainwatch.control.job_nodes import (job_nodes, node_options, rendezvous_args,
                                          rendezvous_options)
from trainwatch.control.outcome import ALREADY_COMPLETE, Ending
from trainwatch.control.run_checks import check_command, check_launch, refuse_rehearsal_dir
from trainwatch.control.run_summary import (ALREADY_COMPLETE_LINE, render as render_summary,
                                            summarize)
from trainwatch.control.run_view import Progress, live_view
from trainwatch.control.supervision import RUN, Job, Supervision
from trainwatch.errors import ConfigError


@contextlib.contextmanager
def _logs_above(console: Console) -> Iterator[None]:
    """Log records printed above the live view, not through it (the root logger's
    handler writes to the real stderr, which would tear the view)."""
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = [RichHandler(console=console, show_path=False)]
    try:
        yield
    finally:
        root.handlers = saved


class _RunCommand(click.Command):
    """``trainwatch run [RUN_DIR] [OPTIONS] [-- COMMAND...]``: what follows ``--`` is the
    user's own job, untouched; before it, options and at most one RUN_DIR in any order."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        split = args.index("--") if "--" in args else len(args)
        command = args[split + 1:]
        rest = super().parse_args(ctx, args[:split])
        before = ctx.params.pop("positional", ())
        if len(before) > 1:
            raise click.UsageError(f"one RUN_DIR before --, got {' '.join(before)}; your own "
                                   "job goes after --: trainwatch run RUN_DIR -- COMMAND ...",
                                   ctx)
        ctx.params["run_dir_arg"] = before[0] if before else None
        ctx.params["command"] = tuple(command)
        return rest

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return [*super().collect_usage_pieces(ctx), "[-- COMMAND [ARGS]...]"]


@click.command("run", cls=_RunCommand)
@click.option("--nproc-per-node", type=NPROC_PER_NODE,
              help="Ranks on this machine (the reference trainer; not with a COMMAND).")
@run_dir_option("Where the run keeps its state (status, metrics, journal, logs); or give it "
                "as RUN_DIR.", own_argument=True, required=True)
@click.option("--steps", type=click.IntRange(min=1), help="Override train.steps.")
@click.option("--config", type=click.Path(dir_okay=False),
              help="Trainer YAML config (see examples/trainer.yaml).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override one trainer config key, e.g. --set optim.lr=1e-3 (repeatable).")
@click.option("--max-restarts", type=int,
              help="torchrun's own restarts of failed ranks before the controller steps in "
                   f"(reference trainer; default {MAX_RESTARTS}). With a COMMAND, give "
                   "torchrun's own flag.")
@click.option("--thresholds", "thresholds_file", type=click.Path(dir_okay=False),
              help="Alert threshold overrides.")
@click.option("--rules", "rules_file", type=click.Path(dir_okay=False), help="Rules file.")
@click.option("--agent-config", type=click.Path(dir_okay=False), help="Agent config file.")
@click.option("--webhook", multiple=True, help="Also POST alerts to this URL (repeatable).")
@click.option("--alertmanager", help="Also send alerts to this Alertmanager (base URL).")
@click.option("--dry-run", is_flag=True, help="Journal what actions would do; do nothing.")
@click.option("--no-live", is_flag=True,
              help="No live view (for logs and CI): only alerts and the outcome are printed.")
@click.option("--telemetry-grace", type=seconds(), default=TELEMETRY_GRACE_SECONDS,
              show_default=True, metavar="SECONDS",
              help="With a COMMAND: say so when no rank has published telemetry this long "
                   "after a start.")
@click.option("--agent-port", type=click.IntRange(1, 65535), metavar="PORT",
              help="The agent's port on loopback, for a Prometheus or a dashboard pointed at "
                   "it (default: a free port, printed at the start).")
@node_options
@rendezvous_options
@click.argument("positional", nargs=-1, metavar="[RUN_DIR]", type=RUN_DIR_PATH)
def run(nproc_per_node, run, steps, config, overrides, max_restarts, thresholds_file,
        rules_file, agent_config, webhook, alertmanager, dry_run, no_live, telemetry_grace,
        agent_port, nnodes, node_rank, node_name, rdzv_endpoint, local_addr, min_nnodes,
        command) -> None:
    """Train with the agent and the embedded alert engine watching (Ctrl-C stops all).

    \b
    trainwatch run runs/exp1 --nproc-per-node 4                  the reference trainer
    trainwatch run runs/exp1 -- COMMAND [ARGS...]                your own job, e.g.
        trainwatch run runs/exp1 -- torchrun --nproc-per-node 4 train.py
    (--run-dir runs/exp1 instead of RUN_DIR works too.)

    A COMMAND gets $TRAINWATCH_RUN_DIR and is restarted, rolled back and stopped like the
    reference trainer; what it must do for that is in docs/own-trainer.md.

    \b
    Several nodes: one `trainwatch run` per node on the shared run directory, e.g.
        trainwatch run runs/exp1 --nnodes 2 --node-rank R --nproc-per-node 4 \\
            --rdzv-endpoint NODE0:29400 --local-addr THIS_NODE
    Node 0 decides the job's repairs; every node carries them out (docs/deploy.md).
    """
    # Everything is checked before anything starts or the run directory is touched; then
    # the run's lock (one supervisor per run directory; what a killed one left is stopped).
    refuse_rehearsal_dir(run)
    nodes = job_nodes(nnodes, node_rank, node_name)
    port = free_port(agent_port or 0)
    ruleset = load_rules(rules_file, thresholds_file)
    console = Console()
    if not console.is_terminal:  # logs and pipes: lines long enough not to break commands
        console = Console(width=120)
    target_steps = None
    if command:
        agent_stall = check_command(
            run, list(command), nproc_per_node=nproc_per_node, steps=steps, config=config,
            overrides=overrides, max_restarts=max_restarts, agent_config=agent_config,
            rendezvous=(rdzv_endpoint, local_addr, min_nnodes))
        job = Job(list(command), own=True)
    else:
        if nproc_per_node is None:
            raise ConfigError("give --nproc-per-node (the reference trainer) or -- COMMAND "
                              "(your own job)", key="--nproc-per-node")
        rendezvous = rendezvous_args(nodes, rdzv_endpoint, local_addr, min_nnodes)
        plan = check_launch(run, nproc_per_node=nproc_per_node, config=config,
                            overrides=list(overrides), steps=steps, agent_config=agent_config,
                            nnodes=nnodes)
        if plan.already_complete:
            console.print(ALREADY_COMPLETE_LINE, highlight=False)
            render_summary(summarize(run, ALREADY_COMPLETE, plan.target_steps), console)
            return
        job = Job(train_command(
            run.root, nproc_per_node, config=config, steps=steps, overrides=list(overrides),
            max_restarts=MAX_RESTARTS if max_restarts is None else max_restarts,
            rendezvous=rendezvous), own=False)
        agent_stall, target_steps = plan.agent_stall, plan.target_steps
    sup = Supervision(run, RUN, job, Policy.from_thresholds(ruleset.thresholds, dry_run=dry_run),
                      nodes)
    sup.attach_engine(ruleset, webhooks=webhook, alertmanager=alertmanager, agent_port=port,
                      agent_config=agent_config, rules_files=(rules_file, thresholds_file))
    if command:
        sup.watch_telemetry(lambda text: click.echo(text, err=True), telemetry_grace)
    agent_url = f"http://{sup.agent_target}"
    progress = Progress(target_steps)
    what = (f"starting {' '.join(command)}" if command
            else f"starting {nproc_per_node} rank(s) under torchrun")
    assert sup.controller is not None, "trainwatch run always runs a job"
    outcome = sup.supervise(
        lambda: (_progress_lines(sup, progress) if no_live
                 else _live(sup, progress, console, agent_url)),
        journal=dict(nproc_per_node=nproc_per_node, command=list(command) or None,
                     agent=[sup.agent_target], rules=len(ruleset.rules), dry_run=dry_run,
                     **{STALL_RECORD_KEY: agent_stall},
                     **({"nodes": nodes.journal()} if nodes is not None else {})),
        started_line=f"trainwatch run: {run.root}: {what}; agent {agent_url}",
        stopping_line=("trainwatch run: stopping the job (SIGTERM, time to save a checkpoint; "
                       f"SIGKILL after {sup.controller.stop_grace:.0f} s) and the agent; "
                       "another Ctrl-C does not cut that short"))
    if outcome.ending is Ending.REJECTED_INPUT:
        raise outcome.refusal(sup.launch)
    render_summary(summarize(run, outcome, target_steps), console)
    message = outcome.message(run, sup.launch)
    if message:
        click.echo(message, err=True)
    if outcome.exit_code:
        sys.exit(outcome.exit_code)


def _live(sup: Supervision, progress: Progress, console: Console, agent_url: str) -> None:
    """The live view, redrawn twice a second until the supervision ends."""
    assert sup.engine is not None and sup.started_at is not None, "an engine run, journaled"
    engine, started, run = sup.engine, sup.started_at, sup.run

    def view():
        return live_view(run, engine, progress.update(run), started, agent_url)

    with Live(view(), refresh_per_second=2, console=console) as live, _logs_above(live.console):
        while not sup.ended(0.5):
            live.update(view())
        live.update(view())


def _progress_lines(sup: Supervision, progress: Progress, every: float = 10.0) -> None:
    """Without the live view: a progress line every ``every`` seconds."""
    assert sup.controller is not None, "trainwatch run always runs a job"
    while not sup.ended(every):
        since = sup.controller.started_at
        click.echo(f"trainwatch run: {progress.update(sup.run, since=since).line()}")
