"""``trainwatch report RUN_DIR``: cost, goodput and what the failures cost."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console

from trainwatch.config.clitypes import run_dir_option
from trainwatch.errors import missing_extra

if TYPE_CHECKING:
    from trainwatch.rundir.run_dir import RunDir


@click.command("report", context_settings={"help_option_names": ["-h", "--help"]})
@run_dir_option("The run directory, if not given as RUN_DIR.", argument=True, required=True)
@click.option("--json", "as_json", is_flag=True,
              help="Print the report as JSON (keys: docs/report.md).")
@click.option("--gpu-hour-price", type=click.FloatRange(min=0), metavar="USD",
              help="Price of one accelerator-hour (overrides --config).")
@click.option("--gpus", type=click.IntRange(min=1),
              help="Accelerators the job held in all [default: the run's world size].")
@click.option("--config", "config_file", type=click.Path(dir_okay=False, path_type=Path),
              help="YAML with gpu_hour_price, gpus or accelerators_per_rank.")
@click.option("--html", "html_file", type=click.Path(dir_okay=False, path_type=Path),
              metavar="FILE", help="Write the report as one self-contained HTML page of charts "
                                   "(no network needed to view it).")
@click.option("--prom-textfile", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write trainwatch_cost_* gauges for node_exporter's textfile "
                   "collector (name it *.prom).")
def report(run: RunDir, as_json: bool,
           gpu_hour_price: float | None, gpus: int | None, config_file: Path | None,
           html_file: Path | None, prom_textfile: Path | None) -> None:
    """Where a run's wall time went: goodput, badput by category, one row per incident
    (interruption) with its cause and cost.

    Reads RUN_DIR/journal.jsonl and rank 0's metrics log; changes nothing in RUN_DIR.
    Exit code 0: report printed; 2: bad input (not a run directory, bad config value).
    """
    from trainwatch.report import cost, goodput, render, timeline
    settings = cost.load_settings(config_file, price=gpu_hour_price, gpus=gpus)
    tl = timeline.read_timeline(run)
    data = render.report(tl, goodput.account(tl), settings)
    if prom_textfile is not None:
        from trainwatch.report.prom import write_textfile
        write_textfile(prom_textfile, data)
    if html_file is not None:
        try:
            from trainwatch.report.html import write_html
        except ImportError as exc:
            raise missing_extra(exc, "html", key="--html") from None
        from trainwatch.report.series import read_series
        write_html(html_file, data, read_series(run))
        if not as_json:
            click.echo(f"wrote {html_file}: open it in a browser (self-contained, works offline)")
            return
    if as_json:
        click.echo(render.to_json(data))
        return
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    render.render(data, console)
