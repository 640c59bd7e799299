"""The base install is small: plotly (`report --html`) and grafana-client (`dashboards
upload`) are extras, and the two commands say what to install when they are missing —
exit 2 with the pip command, never a traceback."""

import subprocess
import sys
import tomllib


from conftest import REPO
from trainwatch.rundir.run_dir import RunDir

BLOCK = "import sys; sys.modules[{name!r}] = None; from trainwatch.cli import main; main()"


def _without(module: str, *args: str, **kwargs):
    return subprocess.run([sys.executable, "-c", BLOCK.format(name=module), *args],
                          capture_output=True, text=True, timeout=120, **kwargs)


def test_plotting_and_grafana_are_extras_the_tests_install():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = " ".join(project["dependencies"])
    assert "plotly" not in base and "grafana-client" not in base
    extras = project["optional-dependencies"]
    assert any(d.startswith("plotly") for d in extras["html"])
    assert any(d.startswith("grafana-client") for d in extras["grafana"])
    assert "trainwatch[html,grafana]" in extras["test"]


def test_dashboards_upload_without_grafana_client_says_what_to_install():
    done = _without("grafana_client", "dashboards", "upload", "--url", "http://127.0.0.1:1/")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "pip install 'trainwatch[grafana]'" in done.stderr and "Traceback" not in done.stderr


def test_report_html_without_plotly_says_what_to_install(tmp_path):
    # A run with something to report (with plotly this writes the page): the missing
    # extra is what stops it, not the run.
    run = RunDir(tmp_path / "run").create()
    run.append_event("run_started", "rank0", rank=0, world_size=1)
    run.append_event("finished", "rank0", rank=0, step=2)
    done = _without("plotly", "report", str(run.root), "--html", str(tmp_path / "r.html"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "pip install 'trainwatch[html]'" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "r.html").exists()
