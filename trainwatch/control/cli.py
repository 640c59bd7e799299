"""``trainwatch alerts receive``: the webhook receiver acting on a run, and the ``alerts``
group users see (the rules' commands from ``trainwatch.alerts.cli`` plus this one)."""

from __future__ import annotations

import sys

import click

from trainwatch.alerts.cli import alerts as rules_commands
from trainwatch.alerts.cli import load_ruleset, rules_option, thresholds_option
from trainwatch.config.clitypes import NPROC_PER_NODE, run_dir_option
from trainwatch.contract.env import RECEIVER_TOKEN_ENV
from trainwatch.contract.ports import LOOPBACK, RECEIVER_LISTEN
from trainwatch.control.job_nodes import node_options, rendezvous_options
from trainwatch.errors import ConfigError


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"'{text}' is not HOST:PORT", key="--listen")
    return host or LOOPBACK, int(port)


def _job(run, job_command, nproc_per_node, config, steps, rendezvous=()):
    """The job the receiver supervises, if it runs one: a command of the user's own (the
    same supervision as ``trainwatch run -- COMMAND``) or the reference trainer."""
    import shlex

    from trainwatch.control.command import resolve
    from trainwatch.control.controller import train_command
    from trainwatch.control.supervision import Job
    if job_command and nproc_per_node:
        raise ConfigError("give either --job-command or --nproc-per-node, not both")
    if job_command:
        command = shlex.split(job_command)
        if not command:
            resolve(command)  # exit 2, as `trainwatch run --` with no command, before the lock
        return Job(command, own=True)
    if nproc_per_node:
        return Job(train_command(run.root, nproc_per_node, config=config, steps=steps,
                                 rendezvous=rendezvous), own=False)
    return None


@click.command("receive")
@rules_option
@thresholds_option
@run_dir_option("The run directory whose job this receiver acts on.", required=True)
@click.option("--listen", default=RECEIVER_LISTEN, show_default=True, metavar="HOST:PORT",
              help="Where to serve the webhook (loopback unless you say otherwise).")
@click.option("--token-file", type=click.Path(dir_okay=False),
              help=f"File holding the bearer token (default: ${RECEIVER_TOKEN_ENV}).")
@click.option("--nproc-per-node", type=NPROC_PER_NODE, help="Also run and supervise `trainwatch train`.")
@click.option("--config", type=click.Path(dir_okay=False), help="Trainer config file.")
@click.option("--steps", type=int, help="Override train.steps.")
@click.option("--job-command",
              help="Supervise this command (quoted, e.g. 'torchrun --nproc-per-node 4 "
                   "train.py') instead of `trainwatch train`: the same as `trainwatch run -- "
                   "COMMAND` (docs/own-trainer.md).")
@click.option("--straggler-command",
              help="Scheduler adapter run for stragglers, e.g. 'scontrol requeue {slurm_job_id}'.")
@click.option("--dry-run", is_flag=True, help="Journal what would be done; do nothing.")
@node_options
@rendezvous_options
def receive(rules_file, thresholds_file, run, listen, token_file, nproc_per_node, config,
            steps, job_command, straggler_command, dry_run, nnodes, node_rank, node_name,
            rdzv_endpoint, local_addr, min_nnodes) -> None:
    """Serve Alertmanager's webhook (POST /webhook) and run trainwatch's automatic actions.

    \b
    Several nodes: one receiver with the job per node, on the shared run directory
    (--nnodes, --node-rank; docs/deploy.md, Multi-node): node 0 decides the repairs.
    """
    from trainwatch.control.actions import Policy
    from trainwatch.control.job_nodes import job_nodes, rendezvous_args
    from trainwatch.control.receiver import load_token
    from trainwatch.control.supervision import RECEIVE, Supervision
    ruleset = load_ruleset(rules_file, thresholds_file)
    token = load_token(token_file)
    host, port = _listen(listen)
    nodes = job_nodes(nnodes, node_rank, node_name)
    rendezvous = (rendezvous_args(nodes, rdzv_endpoint, local_addr, min_nnodes)
                  if nproc_per_node else [])
    given = [k for k, v in (("--rdzv-endpoint", rdzv_endpoint), ("--local-addr", local_addr),
                            ("--min-nnodes", min_nnodes)) if v]
    if job_command and given:
        raise ConfigError("configures the reference trainer; with --job-command put your "
                          "job's own rendezvous in the command", key=given[0])
    job = _job(run, job_command, nproc_per_node, config, steps, rendezvous)
    if nodes is not None and job is None:
        raise ConfigError("a node of a multi-node job supervises its own launcher: give "
                          "--nproc-per-node or --job-command", key="--nnodes")
    sup = Supervision(run, RECEIVE, job, Policy.from_thresholds(
        ruleset.thresholds, dry_run=dry_run, straggler_command=straggler_command), nodes)
    receiver = sup.attach_receiver(ruleset, token, host, port)
    click.echo(f"receiving Alertmanager webhooks on {receiver.url}/webhook "
               f"(job {sup.runner.job}{', dry run' if dry_run else ''})")
    # SIGTERM (systemctl stop, a pod's end) stops the job it started as Ctrl-C does, never
    # leaving it orphaned.
    outcome = sup.supervise(lambda: _serve(sup))
    if outcome.receiver_exit_code:
        sys.exit(outcome.receiver_exit_code)


def _serve(sup) -> None:
    """Until the job's supervision ends (never without a job): a stop signal ends it."""
    while not sup.ended(1.0):
        pass


alerts = click.Group("alerts", commands={**rules_commands.commands, "receive": receive},
                     help="Alert rules (one source), the embedded engine and the webhook receiver.")
