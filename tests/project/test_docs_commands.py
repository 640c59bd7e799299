"""The README, docs/ and runbooks/ name only commands, options, metrics and test files
that exist.

A runbook is read at 3 a.m. and pasted as it is: an option that was renamed (or never
existed) fails there, or worse, hides behind a `|| fallback`.
"""

import re
from pathlib import Path

import click
import pytest

from trainwatch.cli import cli
from trainwatch.contract.metrics import METRICS

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"),
                *(REPO / "trainwatch" / "runbooks").glob("*.md")])
# `trainwatch <words>` then the rest of the command, up to what ends it in prose or shell.
COMMAND = re.compile(r"trainwatch((?:\s+[a-z][a-z-]*)+)([^`|#;&]*)")
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
METRIC = re.compile(r"\btrainwatch_[a-z0-9_]+\b(?!\")")  # not a JSON key


def _resolve(words: list[str]) -> tuple[click.Command, int]:
    """The deepest command the words name, and how many words that took."""
    ctx = click.Context(cli)
    cmd, used = cli, 0
    for word in words:
        if not isinstance(cmd, click.Group):
            break
        sub = cmd.get_command(ctx, word)
        if sub is None:
            break
        cmd, used = sub, used + 1
    return cmd, used


def _commands(page: Path):
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for m in COMMAND.finditer(line):
            words = m.group(1).split()
            cmd, used = _resolve(words)
            if used:
                rest = " ".join(words[used:]) + " " + m.group(2)
                rest = rest.split(" -- ", 1)[0]  # after `--`: the user's own command
                yield number, " ".join(words[:used]), cmd, OPTION.findall(rest)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_documented_option_exists(page):
    unknown = []
    for number, name, cmd, options in _commands(page):
        known = {"-h", "--help"} | {o for p in cmd.params for o in p.opts + p.secondary_opts}
        unknown += [f"{page.name}:{number}: trainwatch {name} {o}"
                    for o in options if o not in known]
    assert not unknown


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_documented_metric_is_in_the_contract(page):
    names = set(METRICS)
    unknown = {m for m in METRIC.findall(page.read_text())
               if not m.endswith("_")  # a prefix, e.g. trainwatch_cost_
               and re.sub(r"_(bucket|count|sum|created)$", "", m) not in names}
    assert not unknown, f"{page.name}: {sorted(unknown)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_code_fences_open_on_their_own_line(page):
    bad = [f"{page.name}:{n}" for n, line in enumerate(page.read_text().splitlines(), 1)
           if "```" in line and not line.lstrip().startswith("```")
           and line.count("```") % 2 == 1]
    assert not bad


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


LINK = re.compile(r"\]\(([^)#\s]*\.md)?#([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_to_a_section_finds_it(page):
    """A link to `page.md#section` lands on a heading of that page (a renamed heading
    leaves the reader at the top of a long page)."""
    broken = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for target, anchor in LINK.findall(line):
            linked = (page.parent / target).resolve() if target else page
            if not linked.is_file():
                broken.append(f"{page.name}:{number}: {target} does not exist")
                continue
            anchors = {_slug(h) for h in re.findall(r"^#+\s+(.*)$", linked.read_text(), re.M)}
            if anchor not in anchors:
                broken.append(f"{page.name}:{number}: {target or page.name}#{anchor}")
    assert not broken


TEST_FILE = re.compile(r"(?<![\w/])tests/[\w/.-]*?\.py\b")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_named_test_file_exists(page):
    """A `tests/....py` a page cites as its proof is where it says (tests moved into
    folders of their own and left the pages pointing at nothing)."""
    missing = [f"{page.name}:{number}: {path}"
               for number, line in enumerate(page.read_text().splitlines(), 1)
               for path in TEST_FILE.findall(line) if not (REPO / path).is_file()]
    assert not missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_documented_subcommand_exists(page):
    """`trainwatch GROUP WORD` in a code span or block names a subcommand of GROUP."""
    unknown = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for m in COMMAND.finditer(line):
            words = m.group(1).split()
            cmd, used = _resolve(words)
            if used and isinstance(cmd, click.Group) and len(words) > used:
                unknown.append(f"{page.name}:{number}: trainwatch {' '.join(words[:used + 1])}")
    assert not unknown


def test_own_trainer_page_starts_with_phase_budgets_as_the_agent_has_them():
    """A newcomer's 90 s evaluation outside a phase is killed at ~9 s: the page says so
    before the loop, with the budgets the agent really uses."""
    from trainwatch.contract.stall import STALL_DEFAULTS

    page = (REPO / "docs" / "own-trainer.md").read_text()
    before_loop = page.split("## The lines your loop needs", 1)[0]
    assert 'with tel.phase("eval"):' in before_loop and "tel.declare_phase(" in before_loop
    budgets = STALL_DEFAULTS["phase_budgets"]
    assert "{" + ", ".join(f"{k}: {v:g}" for k, v in budgets.items()) + "}" in before_loop
    assert f'{budgets["eval"]:g} s by default' in before_loop
    assert f'{STALL_DEFAULTS["floor_seconds"]:g} s and {STALL_DEFAULTS["k"]:g} ×' in before_loop
    assert "## Which checkpoint API" in before_loop


def test_readme_benchmark_figures_are_those_of_docs_benchmarks():
    """The README keeps each benchmark's headline; every figure in it is the measured one
    in docs/benchmarks.md (one table of record, no second set of numbers)."""
    readme = (REPO / "README.md").read_text().split("## Benchmarks", 1)[1].split("\n## ", 1)[0]
    record = (REPO / "docs" / "benchmarks.md").read_text()
    rows = [line.split("|")[3] for line in readme.splitlines()
            if line.startswith("| ") and not line.startswith(("| benchmark", "| ---"))]
    assert len(rows) >= 20
    figures = {f for row in rows for f in re.findall(r"\d[\d,.–]*\d|\d", row)}
    assert figures and not {f for f in figures if f not in record}


def test_readme_contents_lists_every_section():
    readme = (REPO / "README.md").read_text()
    contents = readme.split("## Contents", 1)[1].split("\n## ", 1)[0]
    sections = re.findall(r"^## (.+)$", readme, re.M)
    missing = [h for h in sections if h != "Contents" and f"(#{_slug(h)})" not in contents]
    assert not missing
    assert "## GPU quick-start" in readme
