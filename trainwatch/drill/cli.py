"""``trainwatch drill``: list the drills, run them (a game day), score a kept run directory."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import click

from trainwatch.config.clitypes import NPROC_PER_NODE, run_dir_option, seconds
from trainwatch.drill import catalog, render
from trainwatch.drill.corpus.cli import corpus
from trainwatch.errors import EXIT_PROBLEM, ConfigError, output_error
from trainwatch.process.stopsignals import stop_on_sigterm

if TYPE_CHECKING:
    from trainwatch.rundir.run_dir import RunDir

_DEADLINES = [
    click.option("--detect-within", type=seconds(), metavar="SECONDS",
                 help="Override every drill's detection deadline."),
    click.option("--recover-within", type=seconds(), metavar="SECONDS",
                 help="Override every drill's deadline for the first step after resuming."),
]


def _deadlines(func):
    for option in reversed(_DEADLINES):
        func = option(func)
    return func


@click.group("drill", context_settings={"help_option_names": ["-h", "--help"]})
def drill() -> None:
    """Game day for the run's safety net: inject a real failure (a killed, hung or frozen
    rank, a NaN batch, a straggler, a killed supervisor, a second supervisor, a bit flipped
    in one replica's weights; as root, a rank of node 2 killed or frozen or node 2 lost, on
    two nodes as network namespaces) into a real run under `trainwatch run`, and score how it was
    detected and recovered; `drill corpus` scores `diagnose` on a labelled fault corpus.
    Docs: docs/drill.md."""


drill.add_command(corpus)


@drill.command("list")
@click.option("--json", "as_json", is_flag=True, help="The catalog as JSON (docs/drill.md).")
def list_drills(as_json: bool) -> None:
    """The drills: what each simulates, the fault it injects, what must detect it, what must
    recover, and the pass criteria."""
    from trainwatch.drill.settings import changed_defaults

    changed = {d.name: changed_defaults(d) for d in catalog.DRILLS}
    if as_json:
        click.echo(render.to_json(render.catalog_json(changed)))
        return
    render.render_catalog(render.console_for(), changed)


@drill.command("run")
@click.argument("names", nargs=-1, metavar="NAME...")
@click.option("--all", "run_all", is_flag=True, help="Run every drill of the catalog.")
@click.option("--nproc-per-node", type=NPROC_PER_NODE,
              help="Ranks of the drill's run [default: the drill's own (`drill list --json`: "
                   "nproc_per_node), and no fewer].")
@click.option("--steps", type=int, help="Override the drill's train.steps.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Folder for the drills' run directories [default: a new temporary one].")
@click.option("--keep", is_flag=True,
              help="Keep the run directories of passed drills too (failed ones are always "
                   "kept, as evidence).")
@click.option("--json", "as_json", is_flag=True,
              help="Scorecards as JSON on stdout (docs/drill.md); progress goes to stderr.")
@click.option("--timeout", type=seconds(1), default=300, show_default=True,
              metavar="SECONDS", help="Stop a drill (and fail it) after this long.")
@click.option("--deploy-dir", type=click.Path(file_okay=False, path_type=Path),
              help="The multi-node drills' shipped deploy/ folder (slurm/*.sh, agent.yaml) "
                   "[default: the source checkout's].")
@_deadlines
def run_drills(names: tuple[str, ...], run_all: bool, nproc_per_node: int | None, steps: int | None,
               out: Path | None, keep: bool, as_json: bool, timeout: float,
               deploy_dir: Path | None, detect_within: float | None,
               recover_within: float | None) -> None:
    """Run drills one after another, each on a fresh run directory under --out, and score them.

    The multi-node drills (nodes-*, node-lost) need root: they run 2 nodes as network
    namespaces, with the shipped Slurm scripts.

    Exit code 0: every drill passed; 1: a drill failed; 2: bad usage (unknown drill, bad
    option, a multi-node drill without root); 130: interrupted (everything the drill
    started is stopped, the namespaces deleted).
    """
    from trainwatch.drill.nodes import RUN_PREFIX, check_can_run, run_nodes_drill
    from trainwatch.drill.runner import fresh_run_dir, run_drill
    from trainwatch.drill.score import score, summary, unscored
    from trainwatch.drill.settings import settings_for

    if run_all and names:
        raise ConfigError("give drill names or --all, not both")
    if not run_all and not names:
        raise ConfigError("name at least one drill (see `trainwatch drill list`) or pass --all")
    drills = list(catalog.DRILLS) if run_all else [catalog.get(n) for n in names]
    # Every setting is checked before the first drill starts.
    plans = [settings_for(d, nproc_per_node=nproc_per_node, steps=steps,
                          detect_within=detect_within, recover_within=recover_within)
             for d in drills]
    deploy = next((check_can_run(d, deploy_dir) for d in drills if d.nnodes > 1), None)
    temporary = out is None
    out = Path(tempfile.mkdtemp(prefix="trainwatch-drill-")) if out is None else out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise output_error(exc, out, key="--out") from None
    progress_console = render.console_for(stderr=True)
    console = render.console_for()
    stop_on_sigterm()  # stops the drill as cleanly as Ctrl-C
    cards = []
    for plan in plans:
        nodes = plan.drill.nnodes > 1  # its run directory is named by the Slurm prolog
        run = fresh_run_dir(out, RUN_PREFIX * nodes + plan.drill.name)
        try:
            with render.Progress(progress_console, plan.drill) as progress:
                if nodes and deploy is not None:
                    run_nodes_drill(plan, run, timeout=timeout, deploy_dir=deploy,
                                    on_progress=progress.update)
                else:
                    run_drill(plan, run, timeout=timeout, on_progress=progress.update)
        except KeyboardInterrupt:
            click.echo(f"interrupted: drill {plan.drill.name} stopped; its run directory is "
                       f"kept: {run.root}", err=True)
            raise
        try:
            card = score(run)
        except ConfigError as exc:
            card = unscored(plan.drill, run, str(exc))
        card["kept"] = keep or not card["passed"]
        if not card["kept"]:
            shutil.rmtree(run.root, ignore_errors=True)
        cards.append(card)
        if not as_json:
            render.render_card(card, console)
    if temporary and not any(out.iterdir()):
        out.rmdir()
    if as_json:
        click.echo(render.to_json(summary(cards)))
    else:
        render.render_summary(cards, console)
    if not all(c["passed"] for c in cards):
        sys.exit(EXIT_PROBLEM)


@drill.command("score")
@run_dir_option("The drill's run directory, if not given as RUN_DIR.", argument=True,
                required=True)
@click.option("--json", "as_json", is_flag=True, help="The scorecard as JSON (docs/drill.md).")
@_deadlines
def score_drill(run: RunDir, as_json: bool, detect_within: float | None,
                recover_within: float | None) -> None:
    """Score a drill's kept run directory again (optionally against other deadlines).

    Exit code 0: passed; 1: failed; 2: not a drill's run directory, or nothing to score.
    """
    from trainwatch.drill.score import score, summary
    card = score(run, detect_within=detect_within, recover_within=recover_within)
    if as_json:
        click.echo(render.to_json(summary([card])))
    else:
        render.render_card(card, render.console_for())
    if not card["passed"]:
        sys.exit(EXIT_PROBLEM)
