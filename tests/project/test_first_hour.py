"""A newcomer's first hour, scripted: the demo from a fresh clone, its summary, the commands
the summary names (the text report and the HTML page), a re-run that says it is complete;
and the HTML report in a real headless browser (Chromium): no console errors, no network
fetches, every chart drawn.
"""

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import clone_checkout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # fixtures start real runs


def _env(tmp_path, **extra):
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    return {**os.environ, "TMPDIR": str(scratch), "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A fresh clone of this checkout, and the demo run in it (few steps, no live view)."""
    tmp = tmp_path_factory.mktemp("newcomer")
    clone = tmp / "trainwatch"
    clone_checkout(clone)
    # The clone's code, with the dependencies of the environment running the tests; a
    # length other than the default has its own run directory, runs/demo-30.
    env = _env(tmp, TRAINWATCH_DEMO_SKIP_SETUP="1", TRAINWATCH_DEMO_STEPS="30",
               PYTHONPATH=str(clone), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    first = subprocess.run(["bash", "scripts/demo.sh", "--no-live"], cwd=clone, env=env,
                           capture_output=True, text=True, timeout=600)
    return clone, env, first


def test_demo_ends_with_a_summary_naming_the_next_commands(demo):
    clone, env, first = demo
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    out = first.stdout
    assert "trainwatch run finished: runs/demo-30" in out
    assert "30 of 30" in out and "final loss" in out and "goodput" in out
    assert "trainwatch report runs/demo-30" in out
    assert "trainwatch report runs/demo-30 --html report.html" in out
    assert "agent http://127.0.0.1:" in out                       # where the agent listens
    assert "step " in out                                          # progress lines (--no-live)


def test_the_commands_the_summary_names_work(demo):
    clone, env, first = demo
    report = subprocess.run(["trainwatch", "report", "runs/demo-30"], cwd=clone, env=env,
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert "Where the time went" in report.stdout and "productive steps" in report.stdout
    assert "─" in report.stdout and "+---" not in report.stdout    # box drawing, not ASCII
    page = subprocess.run(["trainwatch", "report", "runs/demo-30", "--html", "report.html"],
                          cwd=clone, env=env, capture_output=True, text=True, timeout=120)
    assert page.returncode == 0, page.stderr
    assert (clone / "report.html").stat().st_size > 0


def test_rerunning_the_finished_demo_says_already_complete(demo):
    clone, env, first = demo
    journal = (clone / "runs/demo-30/journal.jsonl").read_bytes()
    again = subprocess.run(["bash", "scripts/demo.sh", "--no-live"], cwd=clone, env=env,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "Already complete — nothing to do" in again.stdout
    assert "trainwatch report runs/demo-30" in again.stdout
    # Nothing started, nothing journaled: report counts no fake downtime.
    assert (clone / "runs/demo-30/journal.jsonl").read_bytes() == journal


# --------------------------------------------------------------------------- the HTML page

def _browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        if os.environ.get("CI"):
            pytest.fail("CI must have chromium and chromedriver (.ci/run installs them)")
        pytest.skip("needs chromium and chromedriver (Debian: apt install chromium "
                    "chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1300,4000"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=opts)


def test_html_report_renders_every_chart_in_a_real_browser(recovered_run, tmp_path):
    run_dir, _ = recovered_run
    from PIL import Image
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    page = tmp_path / "report.html"
    done = subprocess.run([sys.executable, "-m", "trainwatch", "report", str(run_dir),
                           "--html", str(page)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    text = page.read_text()
    assert "<script src=" not in text and "<link" not in text      # nothing to fetch
    driver = _browser()
    try:
        driver.get(page.as_uri())
        charts = driver.find_elements(By.CSS_SELECTOR, "section.chart")
        assert [c.get_attribute("id") for c in charts] == [
            "chart-time", "chart-progress", "chart-ranks", "chart-checkpoints"]
        WebDriverWait(driver, 60).until(lambda d: d.execute_script(
            "return document.querySelectorAll('section.chart .main-svg').length") >= 4)
        errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
        assert errors == []
        fetched = driver.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)")
        assert fetched == []
        for chart in charts:
            image = Image.open(io.BytesIO(chart.screenshot_as_png)).convert("RGB")
            assert image.size[0] > 300 and image.size[1] > 200, chart.get_attribute("id")
            colours = image.getcolors(1 << 20) or []
            # A blank or broken chart is one or two colours; a drawn one has hundreds.
            assert len(colours) > 50, (chart.get_attribute("id"), len(colours))
        # What the page draws is the run's own story: one restart, one incident.
        assert driver.execute_script(
            "return document.getElementById('plot-progress').data"
            ".filter(t => t.name === 'restart').length") == 1
        assert driver.execute_script(
            "return document.getElementById('plot-progress').data"
            ".filter(t => t.name === 'incident').length") == 1
    finally:
        driver.quit()
