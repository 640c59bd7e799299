"""``trainwatch diagnose``: why is my run stalled (or dead, or slow)?"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import click
from rich.console import Console

from trainwatch.config.clitypes import run_dir_option, seconds
from trainwatch.contract.env import DEFAULT_RUN_DIR, RUN_DIR_ENV, run_dir_from_env
from trainwatch.contract.ports import AGENT_PORT
from trainwatch.diagnose import analysis, bundle, render_human, render_json
from trainwatch.diagnose.gather import Options, gather
from trainwatch.errors import EXIT_OK, EXIT_PROBLEM, ConfigError, output_error
from trainwatch.rundir.run_dir import RunDir


@click.command("diagnose")
@run_dir_option("The run directory to diagnose (or give it as RUN_DIR).", argument=True,
                show_default=f"${RUN_DIR_ENV} or ./{DEFAULT_RUN_DIR}")
@click.option("--agent", "agent_urls", multiple=True, metavar="URL",
              help=f"A node agent (http://host:{AGENT_PORT}); repeat for every node.")
@click.option("--prometheus", "prometheus_url", metavar="URL",
              help="Prometheus to query for firing alerts and rank ages.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report for machines.")
@click.option("--bundle", "bundle_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write a tar.gz of all evidence (secrets redacted).")
@click.option("--native", is_flag=True, help="Include native (C/C++) frames in py-spy stacks.")
@click.option("--timeout", type=seconds(0.5, 300), default=5.0, show_default=True,
              help="Seconds to wait for each source (rank dumps, py-spy, agents, Prometheus).")
@click.option("--stall-after", type=seconds(0.1), default=None,
              help="Seconds without progress that count as a stall [default: the agent's "
                   "stall budget: from its /status, else the options the run recorded, else "
                   "max(5, 10 x median step time)].")
@click.option("--no-dump-request", is_flag=True,
              help="Do not touch control/dump (read-only: use stacks from py-spy only).")
def diagnose(run: RunDir | None, agent_urls: tuple[str, ...], prometheus_url: str | None,
             as_json: bool, bundle_file: Path | None, native: bool, timeout: float,
             stall_after: float | None, no_dump_request: bool) -> None:
    """Gather evidence about a running, stalled or dead run and name the culprit.

    Exit code 0: healthy; 1: a problem was found; 2: bad usage.
    """
    given = run is not None
    run = run if run is not None else RunDir(run_dir_from_env())
    run_dir = run.root
    if not run.exists():
        raise ConfigError("no such run directory" + ("" if given else
                          f" (the default: give RUN_DIR, or set ${RUN_DIR_ENV})"),
                          file=str(run_dir))
    if not (run.status_dir.is_dir() or run.run_file.exists()):
        raise ConfigError("not a trainwatch run directory (no status/ and no run.json)",
                          file=str(run_dir))
    if bundle_file is not None and not bundle_file.resolve().parent.is_dir():
        raise ConfigError("no such folder to write the bundle in", file=str(bundle_file),
                          key="--bundle")
    for key, url in [*(("--agent", u) for u in agent_urls),
                     *([("--prometheus", prometheus_url)] if prometheus_url else [])]:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"'{url}' is not an http(s) URL", key=key)
    options = Options(agent_urls=list(agent_urls), prometheus_url=prometheus_url,
                      timeout=timeout, native=native, request_dumps=not no_dump_request)
    err = Console(stderr=True)
    if err.is_terminal and not as_json:
        with err.status("gathering evidence…") as status:
            ev = gather(run, options, lambda step: status.update(f"gathering: {step}…"))
    else:
        ev = gather(run, options)
    found = analysis.analyse(ev, stall_after)
    problem = any(f.severity in ("critical", "warning") for f in found)
    exit_code = EXIT_PROBLEM if problem else EXIT_OK

    if as_json:
        click.echo(render_json.render(ev, found, exit_code))
    else:
        render_human.render(ev, found, Console())
    if bundle_file:
        text = io.StringIO()  # the human report goes into the bundle too
        render_human.render(ev, found, Console(file=text, width=120, no_color=True))
        try:
            path = bundle.write(bundle_file, run, ev, render_json.report(ev, found, exit_code),
                                text.getvalue())
        except OSError as exc:
            raise output_error(exc, bundle_file, key="--bundle") from None
        click.echo(f"evidence bundle: {path}", err=True)
    sys.exit(exit_code)
