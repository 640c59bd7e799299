"""``trainwatch alerts receive``: the webhook receiver acting on a run, and the ``alerts``
group users see (the rules' commands from ``trainwatch.alerts.cli`` plus this one)."""

from __future__ import annotations

import sys
import time

import click

from trainwatch.alerts.cli import alerts as rules_commands
from trainwatch.alerts.cli import load_ruleset, rules_option, thresholds_option
from trainwatch.config.clitypes import NPROC_PER_NODE, run_dir_option
from trainwatch.contract.env import RECEIVER_TOKEN_ENV
from trainwatch.contract.ports import LOOPBACK, RECEIVER_LISTEN
from trainwatch.errors import EXIT_PROBLEM, ConfigError
from trainwatch.process.stopsignals import stop_on_sigterm, stopping


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"'{text}' is not HOST:PORT", key="--listen")
    return host or LOOPBACK, int(port)


def _job_command(run_dir, job_command, nproc_per_node, config, steps) -> list[str] | None:
    import shlex

    from trainwatch.control.controller import train_command
    if job_command and nproc_per_node:
        raise ConfigError("give either --job-command or --nproc-per-node, not both")
    if job_command:
        return shlex.split(job_command)
    if nproc_per_node:
        return train_command(run_dir, nproc_per_node, config=config, steps=steps)
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
def receive(rules_file, thresholds_file, run, listen, token_file, nproc_per_node, config,
            steps, job_command, straggler_command, dry_run) -> None:
    """Serve Alertmanager's webhook (POST /webhook) and run trainwatch's automatic actions."""
    from trainwatch.control.actions import ActionRunner, Policy
    from trainwatch.control.command import supervised_job
    from trainwatch.control.controller import JobController
    from trainwatch.control.receiver import Receiver, load_token
    from trainwatch.alerts.silences import Silences
    from trainwatch.control.supervise import Supervisor
    from trainwatch.rundir.runlock import hold
    ruleset = load_ruleset(rules_file, thresholds_file)
    token = load_token(token_file)
    host, port = _listen(listen)
    run_dir = str(run.root)
    command = _job_command(run_dir, job_command, nproc_per_node, config, steps)
    controller: JobController | None = None
    # Acting as the job's supervisor: the run's one supervisor (trainwatch.rundir.runlock).
    lock = hold(run, "trainwatch alerts receive") if command else None
    if job_command and command is not None:  # the same supervision as `trainwatch run -- COMMAND`
        controller = supervised_job(run_dir, command, "trainwatch alerts receive")
    elif command:
        controller = JobController(run_dir, command)
    policy = Policy.from_thresholds(ruleset.thresholds, dry_run=dry_run,
                                    straggler_command=straggler_command)
    runner = ActionRunner(run_dir, controller, policy,
                          silences=Silences(run.silences_file))
    receiver = Receiver(ruleset, runner, token, host, port).start()
    click.echo(f"receiving Alertmanager webhooks on {receiver.url}/webhook "
               f"(job {runner.job}{', dry run' if dry_run else ''})")
    supervisor = None
    # SIGTERM (systemctl stop, a pod's end) stops the job it started as Ctrl-C does, never
    # leaving it orphaned.
    stop_on_sigterm()
    if controller is not None:
        controller.start()
        supervisor = Supervisor(controller, runner).start()
    try:
        while supervisor is None or not supervisor.finished.wait(1.0):
            if supervisor is None:
                time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        stopping()
        receiver.stop()
        if supervisor is not None:
            supervisor.stop()
        if controller is not None:
            controller.close("receiver stopped")
        if lock is not None:
            lock.release()
    if supervisor is not None and supervisor.exit_code:
        sys.exit(EXIT_PROBLEM)


alerts = click.Group("alerts", commands={**rules_commands.commands, "receive": receive},
                     help="Alert rules (one source), the embedded engine and the webhook receiver.")
