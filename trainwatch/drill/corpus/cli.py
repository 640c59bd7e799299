"""``trainwatch drill corpus``: run the labelled diagnosis corpus and score it."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import click

from trainwatch.config.clitypes import seconds
from trainwatch.errors import EXIT_PROBLEM, output_error


@click.command("corpus")
@click.argument("kinds", nargs=-1, metavar="[KIND]...")
@click.option("--list", "list_only", is_flag=True,
              help="List the kinds, what each simulates and the expected answer; run nothing.")
@click.option("--repeat", type=click.IntRange(1, 100), default=1, show_default=True,
              help="Runs of each kind.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Folder for the runs' directories [default: a new temporary one].")
@click.option("--keep", is_flag=True, help="Keep the run directories of right answers too "
              "(wrong ones are always kept, as evidence).")
@click.option("--json", "as_json", is_flag=True,
              help="The scored table as JSON on stdout; progress goes to stderr.")
@click.option("--diagnose-within", type=seconds(1), default=45, show_default=True,
              metavar="SECONDS", help="Ask diagnose again until this long after the fault.")
@click.option("--diagnose-timeout", type=seconds(1), default=60, show_default=True,
              metavar="SECONDS", help="Give up on one diagnose call after this long.")
def corpus(kinds: tuple[str, ...], list_only: bool, repeat: int, out: Path | None, keep: bool,
           as_json: bool, diagnose_within: float, diagnose_timeout: float) -> None:
    """Run the diagnosis corpus: each KIND (default: all) is a fault injected into a real
    `trainwatch run -- torchrun` gloo job, and `trainwatch diagnose` must name the rank and
    the cause. Scores per kind: rank right, cause right, seconds to detect and to diagnose,
    false findings in a clean run. Docs: docs/drill.md, the figures in docs/benchmarks.md.

    Exit code 0: every run right and within the goals; 1: not; 2: bad usage.
    """
    from trainwatch.drill.corpus import case as cases, render, score
    from trainwatch.process.stopsignals import stop_on_sigterm

    chosen = [cases.load(k) for k in (kinds or cases.kinds())]
    if list_only:
        click.echo(json.dumps([c.to_json() for c in chosen], indent=2) if as_json
                   else render.catalog(chosen))
        return
    from trainwatch.drill.corpus.runner import run_case

    temporary = out is None
    out = Path(tempfile.mkdtemp(prefix="trainwatch-corpus-")) if out is None else out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise output_error(exc, out, key="--out") from None
    stop_on_sigterm()
    cards: list[dict] = []
    skipped: dict[str, str] = {}
    total = len(chosen) * repeat
    for i, case in enumerate([c for c in chosen for _ in range(repeat)], 1):
        reason = skipped.get(case.kind) or cases.unmet_needs(case)
        if reason:
            click.echo(f"[{i}/{total}] {case.kind}: skipped: {reason}", err=True)
            skipped[case.kind] = reason
            continue
        click.echo(f"[{i}/{total}] {case.kind}: {case.simulates}", err=True)
        run, record = run_case(case, out, diagnose_within=diagnose_within,
                               diagnose_timeout=diagnose_timeout,
                               on_progress=lambda text: click.echo(f"    {text}", err=True))
        card = score.card(case, record)
        card["run_dir"] = str(run.root)
        good = (not card["false_findings"]) if card["clean"] else (
            card["rank_right"] and card["cause_right"])
        click.echo(f"    {'right' if good else 'WRONG'}: " + (
            f"{len(card['false_findings'])} false finding(s) {card['false_findings']}"
            if card["clean"] else f"rank {'right' if card['rank_right'] else 'wrong'}, cause "
            f"{'right' if card['cause_right'] else 'wrong'}, detected "
            f"{card['detect_seconds']} s ({card['detected_by']}), diagnosed "
            f"{card['diagnose_seconds']} s" + (f"; {card['error']}" if card["error"] else "")),
            err=True)
        card["kept"] = keep or not good
        if not card["kept"]:
            shutil.rmtree(run.root, ignore_errors=True)
        cards.append(card)
    if temporary and not any(out.iterdir()):
        out.rmdir()
    result = score.table({c.kind: c for c in chosen}, cards)
    result["skipped"] = [{"kind": k, "reason": r} for k, r in skipped.items()]
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(render.table(result) + "\n\n" + render.summary(result))
    if not result["goals"]["met"] and any(not c["clean"] for c in cards) or \
            any(c["false_findings"] for c in cards):
        sys.exit(EXIT_PROBLEM)



