"""The ``trainwatch`` command line.

Each component owns its commands in its own module; this file only wires them
into one click group, importing lazily so ``trainwatch --help`` stays fast and
a broken optional component cannot break the others.
"""

from __future__ import annotations

import importlib
import logging
import signal
import sys

import click

from trainwatch import __version__
from trainwatch.errors import EXIT_INTERRUPTED, EXIT_OK, TrainwatchError

# command name -> "module:attribute" of a click command or group.
COMMANDS = {
    "train": ("trainwatch.trainer.cli:train",
               "Run the reference trainer under torchrun with a restart policy."),
    "agent": ("trainwatch.agent.cli:agent",
               "Run the per-node agent: health collectors, stall and straggler detection."),
    "close": ("trainwatch.control.close:close",
               "End a run whose job is gone (a node rebooted): it pages nobody until restarted."),
    "checkpoint": ("trainwatch.rank.checkpoint.cli:checkpoint",
                    "List, verify and compare checkpoints (digest of the weights)."),
    "data": ("trainwatch.trainer.cli:data", "Prepare and inspect token datasets."),
    "diagnose": ("trainwatch.diagnose.cli:diagnose",
                  "Why is my run stalled? Gather evidence and name the culprit."),
    "alerts": ("trainwatch.control.cli:alerts",
                "Check, export, test and silence alert rules; run the engine and webhook receiver."),
    "runbook": ("trainwatch.runbooks.cli:runbook", "Print the runbook of an alert."),
    "dashboards": ("trainwatch.dashboards.cli:dashboards",
                    "Export, check and upload the Grafana dashboards."),
    "preflight": ("trainwatch.preflight.cli:preflight",
                   "Is this node fit to join a training job? GPUs, storage, host, network, versions."),
    "report": ("trainwatch.report.cli:report",
                "Cost and goodput of a run: where the wall time went, what failures cost."),
    "drill": ("trainwatch.drill.cli:drill",
               "Game day: inject real failures into a real run; score detection and recovery."),
    "plan": ("trainwatch.plan.cli:plan",
              "Size a run: memory per device, compute, cost, storage, interruptions."),
    "rehearse": ("trainwatch.rehearse.cli:rehearse",
                  "A short real run before the big one: PASS/WARN/FAIL per check."),
    "config": ("trainwatch.config.schema:config",
                "Config files: print or export the JSON Schema of each, for editors."),
    "run": ("trainwatch.control.run:run",
             "Train with the agent and the embedded alert engine watching; restarts from checkpoints."),
}


class LazyGroup(click.Group):
    """A click group whose sub-commands are imported only when used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        target = COMMANDS[name][0]
        module_name, attr = target.split(":")
        return getattr(importlib.import_module(module_name), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Short help from the table, without importing every component (torch is slow).
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="trainwatch")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def cli(verbose: int) -> None:
    """trainwatch: observe and keep alive distributed PyTorch training runs."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main() -> None:
    # Ctrl-C (SIGINT) always stops a command cleanly, also when this process inherited an
    # ignored SIGINT: a non-interactive shell starts background jobs that way, and then
    # daemons like `trainwatch run` could only be stopped with SIGKILL, orphaning the job.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except TrainwatchError as exc:
        click.echo(f"trainwatch: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)
    else:
        sys.exit(EXIT_OK)
