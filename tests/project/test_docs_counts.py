"""The docs state no count of tests: every commit that adds one would have to bump it.

The README says how long the suite takes and how to count its tests instead.
"""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
TEST_COUNT = re.compile(r"\b\d[\d,]*\s+(?:tests|test cases)\b")
COUNT_COMMAND = "python -m pytest --collect-only -q | tail -1"


def test_no_page_states_a_test_count():
    stated = [f"{page.relative_to(REPO)}: {m.group(0)}" for page in PAGES
              for m in TEST_COUNT.finditer(" ".join(page.read_text().split()))]
    assert stated == []


def test_the_readme_states_the_suites_duration_and_how_to_count_its_tests():
    readme = " ".join((REPO / "README.md").read_text().split())
    assert re.search(r"about \d+ minutes for the whole suite on the 2-core VM", readme)
    assert f"`{COUNT_COMMAND}` counts its tests" in readme


def test_the_count_command_counts():
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "tests/project/test_docs_counts.py"], capture_output=True, text=True,
                         cwd=REPO)
    assert re.fullmatch(r"3 tests collected in [\d.]+s", out.stdout.strip().splitlines()[-1])
