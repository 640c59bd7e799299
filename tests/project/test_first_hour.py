"""A newcomer's first hour: the HTML report in a real headless browser (Chromium): no
console errors, no network fetches, every chart drawn. The demo from a fresh clone, its
summary, the commands the summary names and a re-run that says it is complete are
tests/project/test_newcomer_readme.py's, which follows the README in fresh shells.
"""

import io
import os
import shutil
import subprocess
import sys

import pytest


pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # fixtures start real runs


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
