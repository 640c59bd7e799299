"""trainwatch itself: are the agents and their collectors healthy and cheap?"""

from __future__ import annotations

from trainwatch.alerts.rules import AGENT_JOB
from trainwatch.contract.states import COLLECTOR_STATES as STATES
from trainwatch.dashboards.panels import Board, states, target

STATE_COLORS = {"ok": "green", "failed": "red", "timeout": "dark-red", "absent": "text",
                "pending": "blue", "disabled": "text"}
COLLECTOR = "{{node}} {{collector}}"


def build(runbook_base: str, limits: dict) -> dict:
    b = Board("self", "trainwatch / trainwatch itself",
              "The node agents: scrape health, collectors, their cost, skipped status files "
              "and journal lines.",
              ("node",), runbook_base)

    job = limits[AGENT_JOB]  # the scrape job TrainwatchAgentDown selects too
    b.row("Agents")
    b.stat("Agents scraped", target(f'sum(up{{job="{job}"}})', "up"),
           target(f'count(up{{job="{job}"}})', "of"),
           description="Agent targets Prometheus scraped successfully (scrape job "
                       f"{job}, as in deploy/prometheus/prometheus.yml).",
           alerts=("TrainwatchAgentDown",), w=4)
    b.stat("Collectors up", target(f"sum({b.sel('trainwatch_collector_up')})", "up"),
           target(f"count({b.sel('trainwatch_collector_up')})", "of"),
           description="Collectors whose last run succeeded; absent ones (no GPU, no "
                       "InfiniBand) count as not up.", alerts=("TrainwatchCollectorFailing",),
           w=4)
    b.stat("Run directories", target(f"sum({b.sel('trainwatch_collector_run_dirs')})"),
           description="Run directories the agents watch.", w=4)
    b.timeseries("Agent CPU", target(b.rate("trainwatch_collector_agent_cpu_seconds_total"),
                                     "{{node}}"),
                 unit="percentunit", description="CPU time per second of the agent process "
                                                 "(1 = one core); the budget is 1 %.", w=6,
                 h=4)
    b.timeseries("Agent memory (RSS)",
                 target(b.sel("trainwatch_collector_agent_resident_memory_bytes"), "{{node}}"),
                 unit="bytes", description="Resident set size of the agent process.", w=6,
                 h=4)

    b.row("Collectors")
    b.state_timeline("Collector state",
                     target(b.enum("trainwatch_collector_state", "state", STATES,
                                   "node, collector"), COLLECTOR),
                     mappings=states(STATES, STATE_COLORS),
                     description="ok, failed (raised), timeout (hung: e.g. a stuck mount), "
                                 "absent (no such hardware), pending; the reason is in the "
                                 "agent's /status.", alerts=("TrainwatchCollectorFailing",),
                     w=24)
    b.timeseries("Collector run time",
                 target(b.sel("trainwatch_collector_duration_seconds"), COLLECTOR),
                 unit="s", description="Duration of each collector's last completed run.", w=6)
    b.timeseries("Since last success",
                 target(f"time() - "
                        f"{b.sel('trainwatch_collector_last_success_timestamp_seconds')}",
                        COLLECTOR),
                 unit="s", description="Grows while a collector keeps failing: its metrics "
                                       "are that old.", alerts=("TrainwatchCollectorFailing",),
                 w=6)
    b.timeseries("Collector runs", target(b.rate("trainwatch_collector_runs_total"), COLLECTOR),
                 unit="ops", description="Runs started per second.", w=6)
    b.timeseries("Collector errors",
                 target(b.increase("trainwatch_collector_errors_total"), "raised " + COLLECTOR),
                 target(b.increase("trainwatch_collector_timeouts_total"),
                        "timed out " + COLLECTOR),
                 description="Runs that raised, and runs abandoned after their timeout.",
                 alerts=("TrainwatchCollectorFailing",), w=6)
    b.timeseries("Skipped status files",
                 target(b.increase("trainwatch_collector_status_files_skipped_total"),
                        "{{node}} {{run}} {{reason}}"),
                 description="Status files the agent rejected, by reason: special files "
                             "(FIFOs, devices), links out of the run directory, permission "
                             "denied, too large, "
                             "torn or nested too deeply, alien, wrong rank or field types "
                             "(listed in /status).")
    b.timeseries("Unreadable run files",
                 target(b.sel("trainwatch_collector_run_files_unreadable"), "{{node}} {{run}}"),
                 description="Files and folders of a run the agent may not read (permission "
                             "denied): its ranks there are unseen. docs/run-directory.md, "
                             "Permissions.", alerts=("TrainwatchRunUnreadable",))
    b.timeseries("Skipped journal lines",
                 target(b.increase("trainwatch_collector_journal_lines_skipped_total"),
                        "{{node}} {{run}}"),
                 description="Journal lines the agent skipped as torn, alien or overlong "
                             "(the last few are listed in /status under the job's journal); "
                             "the events on them are missing from the alert, action and "
                             "restart counters.")
    b.timeseries("Rank telemetry errors",
                 target(f"sum by (node, run) "
                        f"({b.increase('trainwatch_rank_telemetry_errors_total')})",
                        "{{node}} {{run}}"),
                 description="Failures the trainer's telemetry counted (never raised into the "
                             "training loop).")
    return b.to_json()
