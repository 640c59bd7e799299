"""Every dashboard query, run by a real Prometheus over a real job.

A real 2-rank gloo run (`trainwatch train`), a real `trainwatch agent` watching it, and
Debian's Prometheus scraping the agent with the shipped scrape config (no honor_labels) and
trainwatch's exported alert rules loaded.
Each panel, variable and annotation query runs through /api/v1/query with the template
variables set as Grafana would (run = the run, node and rank = All, $__rate_interval =
15s): every one must succeed, and the panels a CPU training run feeds must show data;
every series an alert rule reads arrives (bar those a CPU run lacks), labelled as the
rules expect.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys

import pytest

from agent_helpers import free_port, http_get, start_agent, stop_process, wait_for
from deploy_configs import prometheus_config
from trainwatch.alerts.rules import load_rules
from trainwatch.contract.metrics import METRICS, MetricSpec
from trainwatch.dashboards.check import check_with_prometheus, prometheus_query
from trainwatch.dashboards.generate import build_all

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("prometheus") is None,
                                                   reason="Debian prometheus is not installed")]

# Panels whose every query ("title"), or one query ("title#refId"), must return series on
# a CPU run: no GPU, InfiniBand or NCCL here, one node, no validation, no alert controller.
MUST_SHOW_DATA = {
    "trainwatch-training-overview": {
        "Ranks up", "Step", "Stalled ranks", "Stragglers", "Tokens/s", "Checkpoint age",
        "Restarts", "Loss#A", "Gradient norm", "Throughput", "Learning rate", "Non-finite steps",
        "Step time", "Step phases", "Data wait", "Heartbeat age", "Current phase per rank",
        "Work at risk (checkpoint age)", "Last checkpoint save", "Checkpoint saves and failures",
        "Restarts and restart guard#A", "Restarts and restart guard#C", "Alerts fired#A",
        "Automated actions"},
    "trainwatch-ranks-stragglers": {
        "Step time", "Local time", "Progress age", "Time ratio to the job median",
        "Straggler score", "Straggler flags#A", "Slow windows", "Stalled", "Stall time and budget",
        "Rank state", "Process state", "Process CPU", "CPU contention", "Process memory (RSS)",
        "Threads", "Ranks"},
    "trainwatch-node-health": {"Free space", "Free bytes", "Probe latency", "Time to full",
                               "Disk throughput", "NIC throughput", "Peer TCP connect time",
                               "Peers reachable", "Versions"},
    "trainwatch-self": {"Agents scraped", "Collectors up", "Run directories", "Agent CPU",
                        "Agent memory (RSS)", "Collector state", "Collector run time",
                        "Since last success", "Collector runs", "Collector errors",
                        "Skipped status files", "Unreadable run files",
                        "Skipped journal lines",
                        "Rank telemetry errors"},
}


# Absent on a healthy one-node CPU run of `trainwatch train`: no GPU, InfiniBand or NCCL, no
# stall, no controller (so no supervisor to watch), no NaN, and no other node to compare this
# node's ranks with or to hold a link to.
CPU_ABSENT = re.compile(r"trainwatch_(gpu_|nccl_ras_|nccl_log_|network_ib_|stall_incident_"
                        r"|action_restart_guard|run_supervisor_|train_last_nonfinite"
                        r"|straggler_node_|link_)")
# Series that exist only once something went wrong (a replica's weights diverged, a
# gradient all-reduce's checksum did not match, a node stopped reporting).
HEALTHY_ABSENT = re.compile(r"trainwatch_(replica_divergence_"
                            r"|rank_reduction_checksum_last_mismatch_|run_node_silent_)")
NO_RUN = MetricSpec("", "", "", ())


def _series(prom: str, expr: str) -> list:
    return prometheus_query(prom, expr)["data"]["result"]


def _check_dashboards(prom: str, run: str) -> tuple[list, list[str]]:
    """Every dashboard's queries run once: (query problems, must-show panels with no data)."""
    problems, empty = [], []
    for dashboard in build_all():
        found, counts = check_with_prometheus(
            dashboard, prom, {"run": run, "node": ".*", "rank": ".*"}, duration="15s")
        problems += found
        assert len(counts) >= 10
        wanted = MUST_SHOW_DATA[dashboard["uid"]]
        ran = {q.panel.removeprefix("panel '")[:-1]: q for q in counts}
        assert {w.split("#")[0] for w in wanted} <= set(ran)
        for q, n in counts.items():
            title = q.panel.removeprefix("panel '")[:-1]
            if n == 0 and (title in wanted or f"{title}#{q.ref}" in wanted
                           or q.panel.startswith("variable")):
                empty.append(f"{q.dashboard}: {q.panel} {q.ref} {q.expr}")
    return problems, empty


def test_every_dashboard_query_runs_against_a_real_prometheus(tmp_path, launch_train):
    run_dir = tmp_path / "run"
    train = launch_train("--nproc-per-node", "2", "--run-dir", str(run_dir), "--steps", "100000",
                         "--set", "telemetry.heartbeat_interval=0.2",
                         "--set", "telemetry.exchange_every=5",
                         "--set", "checkpoint.every_steps=10", "--set", "checkpoint.fsync=false",
                         "--set", "train.eval_interval=0")
    config = tmp_path / "agent.yaml"
    config.write_text("collectors:\n  ranks: {interval: 0.5}\n  storage: {interval: 2}\n"
                      "  network: {interval: 2}\n")
    agent, agent_url = start_agent(tmp_path, "--run-dir", str(run_dir), config=config)
    rules = tmp_path / "rules.yaml"
    subprocess.run([sys.executable, "-m", "trainwatch", "alerts", "export", "-o", str(rules)],
                   check=True)
    port = free_port()
    prometheus_config(tmp_path / "prometheus.yml", rules,
                      {"trainwatch-agent": [agent_url.removeprefix("http://")]})
    prom_proc = subprocess.Popen(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=open(tmp_path / "prometheus.log", "wb"), stderr=subprocess.STDOUT)
    prom = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http_get(prom + "/-/ready"), 60, what="prometheus ready")
        # Both ranks training, timing windows exchanged, a save journaled, a few scrapes
        # for rate().
        wait_for(lambda: len(_series(prom, "rate(trainwatch_rank_steps_total[15s]) > 0")) == 2
                 and len(_series(prom, "trainwatch_straggler_time_ratio")) == 2
                 and len(_series(prom, "trainwatch_checkpoint_age_seconds")) == 1
                 and len(_series(prom, "increase(trainwatch_train_restarts_total[15s])")) == 2
                 and len(_series(prom, "trainwatch_checkpoint_last_save_duration_seconds")) == 1,
                 120, interval=0.5, what="both ranks training, scraped by Prometheus")
        # The shipped scrape config keeps `job` for the scrape job; the run is `run`.
        up = _series(prom, "trainwatch_rank_up")[0]["metric"]
        assert up["job"] == "trainwatch-agent" and "exported_job" not in up
        run = up["run"]

        # A counter's increase() needs two scrapes of it inside the window, and a save's
        # counters first appear a scrape or two after the save: wait for the panels to fill
        # rather than judge the first instant.
        problems, empty = [], []

        def panels_show_data() -> bool:
            problems[:], empty[:] = _check_dashboards(prom, run)
            return not problems and not empty

        try:
            wait_for(panels_show_data, 60, interval=1, what="every must-show panel to show data")
        except AssertionError:
            pass
        assert not problems, "\n".join(map(str, problems))
        assert not empty, "no data:\n" + "\n".join(empty)

        # Every alert expression reads series this scrape config delivers, with `run` where
        # the contract says so (none arrive as exported_job), bar CPU_ABSENT and HEALTHY_ABSENT.
        missing = []
        for rule in load_rules().rules:
            for name in sorted(set(re.findall(r"\b(trainwatch_[a-z0-9_]+|up)\b", rule.expr))):
                if CPU_ABSENT.match(name) or HEALTHY_ABSENT.match(name):
                    continue
                series = _series(prom, name)
                wrong = [s["metric"] for s in series if s["metric"].get("job") !=
                         "trainwatch-agent" or ("run" in METRICS.get(name, NO_RUN).labels
                                                and "run" not in s["metric"])]
                if not series or wrong:
                    missing.append(f"{rule.name}: {name} {'no series' if not series else wrong}")
        assert not missing, "\n".join(missing)

        # A query Prometheus refuses is reported with dashboard, panel and reason.
        problems, _ = check_with_prometheus(build_all()[0], prom, {"run": "("})
        assert problems and all("error parsing regexp" in p.problem for p in problems)
        assert problems[0].dashboard == "trainwatch-training-overview"

        # The CLI's own check against the same Prometheus.
        out = subprocess.run([sys.executable, "-m", "trainwatch", "dashboards", "check",
                              "--prometheus", prom], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "0 problem(s) in 4 dashboard(s)" in out.stdout
    finally:
        stop_process(prom_proc)
        stop_process(agent)
        train.send_signal(signal.SIGTERM)
        train.wait(60)
