"""Training run overview: is the job making progress, how fast, and what is wrong with it."""

from __future__ import annotations

from trainwatch.contract.states import KNOWN_PHASES
from trainwatch.alerts.rules import load_rules
from trainwatch.dashboards.panels import Board, flags, match, states, target

PHASE_COLORS = {"data": "orange", "checkpoint": "purple", "eval": "yellow", "idle": "text",
                "finished": "blue", "init": "light-blue", "telemetry_exchange": "dark-purple",
                "backward": "green", "forward": "light-green", "optimizer": "super-light-orange",
                "step": "dark-red"}


def build(runbook_base: str, limits: dict) -> dict:
    b = Board("training-overview", "trainwatch / Training run overview",
              "One training job: progress, loss, throughput, step time, ranks, checkpoints "
              "and the alerts that fire for it.", ("run", "node", "rank"),
              runbook_base, single_run=True)
    b.annotate("Alerts", 'ALERTS{alertstate="firing", run=~"$run"}', "{{alertname}}",
               "{{severity}} rank {{rank}} {{node}}")

    _now(b, limits)
    _training(b)
    _step_time(b)
    _ranks(b)
    _checkpoints(b, limits)
    _alerts_and_actions(b, runbook_base)
    return b.to_json()


def _now(b: Board, limits: dict) -> None:
    """Where the job stands now: ranks up, step, stalls, throughput, checkpoint age."""
    b.row("Now")
    # "of" is what the run's record expects (its world size), whatever the node filter
    # and whichever nodes still report: a lost node's ranks read 0 of 4, not 0 of 2.
    expected = f"max(trainwatch_run_ranks_expected{{{match('run', '$run', '=~')}}})"
    b.stat("Ranks up", target(f"sum({b.sel('trainwatch_rank_up')})", "up"),
           target(f"{expected} or count({b.sel('trainwatch_rank_up')})", "of"),
           description="Rank processes alive (not zombie) / ranks the run expects (its "
                       "world size; ranks reported where the record says none).",
           alerts=("TrainingRankDown", "TrainingRanksMissing", "TrainingStartupFailed"))
    b.stat("Step", target(f"max({b.sel('trainwatch_rank_step')})"),
           description="Last step any rank started.")
    b.stat("Stalled ranks", target(f"sum({b.sel('trainwatch_rank_stalled')})"), limit=1,
           description="Ranks whose step has not advanced within their stall budget.",
           alerts=("TrainingStalled",))
    b.stat("Stragglers", target(f"sum({b.sel('trainwatch_straggler_active')})"), limit=1,
           description="Ranks flagged as stragglers (see Ranks & stragglers).",
           alerts=("TrainingStragglerRank",))
    b.stat("Tokens/s", target(f"sum({b.sel('trainwatch_train_tokens_per_second')})"),
           description="Job throughput: the sum over the selected ranks.",
           alerts=("TrainingThroughputDrop",))
    b.stat("MFU", target(f"avg({b.sel('trainwatch_train_mfu_ratio')})"), unit="percentunit",
           description="Model FLOPs utilisation, mean over ranks; empty when the GPU peak "
                       "is unknown (CPU runs).")
    b.stat("Checkpoint age", target(f"min({b.sel('trainwatch_checkpoint_age_seconds')})"),
           unit="s", limit=limits["checkpoint_max_age_seconds"],
           description="Since the newest verified checkpoint (since the start if none); "
                       "only while ranks run.", alerts=("CheckpointTooOld",))
    b.stat("Restarts", target(f"max({b.sel('trainwatch_rank_restarts')})"),
           description="Restarts torchrun reports for the current rank processes.",
           alerts=("TrainingRestartLoop",))


def _training(b: Board) -> None:
    """How the model learns: loss, gradients, throughput, non-finite steps."""
    b.row("Training")
    b.timeseries("Loss", target(b.sel("trainwatch_train_loss"), "rank {{rank}}"),
                 target(b.sel("trainwatch_train_validation_loss"), "validation rank {{rank}}"),
                 description="Latest training loss per rank, and validation loss.",
                 alerts=("TrainingLossSpike", "TrainingLossNotDecreasing",
                         "TrainingLossNonFinite"))
    b.timeseries("Gradient norm", target(b.sel("trainwatch_train_grad_norm"), "rank {{rank}}"),
                 description="Before clipping; DDP ranks see the same global norm.")
    b.timeseries("Throughput",
                 target(f"sum by (run) ({b.sel('trainwatch_train_tokens_per_second')})",
                        "tokens/s"),
                 target(f"sum by (run) ({b.sel('trainwatch_train_samples_per_second')})",
                        "samples/s"),
                 description="Job throughput, summed over ranks.",
                 alerts=("TrainingThroughputDrop",))
    b.timeseries("MFU per rank", target(b.sel("trainwatch_train_mfu_ratio"), "rank {{rank}}"),
                 unit="percentunit", min_=0, max_=1,
                 description="Model FLOPs utilisation per rank (0-1).")
    b.timeseries("Learning rate", target(b.sel("trainwatch_train_learning_rate"),
                                         "rank {{rank}}"),
                 description="Current learning rate of the schedule.")
    b.timeseries("Non-finite steps",
                 target(f"sum by (run) ({b.increase('trainwatch_train_nonfinite_loss_total')})",
                        "NaN/Inf loss"),
                 target(f"sum by (run) "
                        f"({b.increase('trainwatch_train_nonfinite_grad_norm_total')})",
                        "NaN/Inf grad norm"),
                 target(f"max by (run) "
                        f"({b.increase('trainwatch_train_nonfinite_skipped_steps_total')})",
                        "skipped by the guard"),
                 description="Steps whose loss or gradient norm was NaN or Inf, and the "
                             "steps the checkpoint library's non-finite guard skipped "
                             "(their optimizer update was not applied).",
                 alerts=("TrainingLossNonFinite",))


def _step_time(b: Board) -> None:
    """Where each step's time goes."""
    b.row("Step time")
    b.timeseries("Step time", target(b.sel("trainwatch_rank_step_time_seconds"),
                                     "rank {{rank}}"),
                 unit="s", description="Wall time of each rank's last step.")
    b.timeseries("Step phases",
                 target(f"avg by (phase) ({b.sel('trainwatch_rank_phase_time_seconds')})",
                        "{{phase}}"),
                 unit="s", stack=True,
                 description="Where the last step's time went, mean over the selected ranks "
                             "(stacked: the top is about the step time).")
    b.timeseries("Data wait", target(b.sel("trainwatch_rank_data_wait_seconds"),
                                     "rank {{rank}}"),
                 unit="s", description="Time the last step waited for data; a growing share "
                                       "of the step time means the input pipeline is slow.")


def _ranks(b: Board) -> None:
    """What each rank is doing."""
    b.row("Ranks")
    b.timeseries("Heartbeat age", target(b.sel("trainwatch_rank_heartbeat_age_seconds"),
                                         "rank {{rank}}"),
                 unit="s", description="Since the rank's telemetry thread last wrote its "
                                       "status; grows without bound when the process is "
                                       "frozen or dead.",
                 alerts=("TrainingStalled", "TrainingRankDown"))
    b.state_timeline("Current phase per rank",
                     target(b.enum("trainwatch_rank_phase", "phase", KNOWN_PHASES,
                                   "run, rank"), "rank {{rank}}"),
                     mappings=states(KNOWN_PHASES, PHASE_COLORS),
                     description="What each rank is doing; a rank alone in a phase while "
                                 "the others wait in a collective is the one to look at.",
                     alerts=("TrainingStalled",), w=16)


def _checkpoints(b: Board, limits: dict) -> None:
    """Saves, their cost and the work a crash would lose."""
    b.row("Checkpoints")
    b.timeseries("Work at risk (checkpoint age)",
                 target(f"min by (run) ({b.sel('trainwatch_checkpoint_age_seconds')})", "age"),
                 unit="s", limit=limits["checkpoint_max_age_seconds"],
                 description="Work a crash would lose now; drops at every verified save.",
                 alerts=("CheckpointTooOld",), w=6)
    in_checkpoint = b.sel("trainwatch_rank_phase", match("phase", "checkpoint"))
    b.timeseries("Checkpoint save in progress",
                 target(f"{b.sel('trainwatch_rank_phase_age_seconds')} "
                        f"and on(run, rank) {in_checkpoint} == 1", "rank {{rank}}"),
                 unit="s", description="How long each rank has been in the checkpoint "
                                       "phase: each peak is one save's blocking time.", w=6)
    b.timeseries("Last checkpoint save",
                 target(f"max by (run) "
                        f"({b.sel('trainwatch_checkpoint_last_save_duration_seconds')})",
                        "write"),
                 target(f"max by (run) "
                        f"({b.sel('trainwatch_checkpoint_last_blocking_seconds')})",
                        "loop blocked"),
                 unit="s", description="The newest save, from the journal: time to write and "
                                       "fsync its files (in the background in async mode) "
                                       "and time the training loop was blocked; a growing "
                                       "write time means slow or filling storage.", w=6)
    b.timeseries("Checkpoint saves and failures",
                 target(f"max by (run) ({b.increase('trainwatch_checkpoint_saves_total')})",
                        "verified saves"),
                 target(f"max by (run) ({b.increase('trainwatch_checkpoint_failures_total')})",
                        "failed saves"),
                 description="Verified and failed checkpoint saves; after a failure the "
                             "previous verified checkpoint is kept.",
                 alerts=("CheckpointFailed", "CheckpointFailedRepeatedly"), w=6)


def _alerts_and_actions(b: Board, runbook_base: str) -> None:
    """What fired and what the controller did about it."""
    b.row("Alerts and actions")
    base = runbook_base
    b.table("Firing alerts",
            target('ALERTS{alertstate="firing", run=~"$run"}', table=True),
            hide=("alertstate",), links={"alertname": base + "${__value.raw}.md"},
            description="Alerts Prometheus fires for this job now; click an alert name for "
                        "its runbook.", w=9)
    acting = [r for r in load_rules().rules if r.action]
    b.state_timeline("Alerts that trigger an action",
                     *[target(f'ALERTS{{alertstate="firing", run=~"$run", '
                              f'alertname="{r.name}"}}',
                              f"{r.name} ({r.action})")
                       for r in acting],
                     mappings=flags("", "firing", "orange"),
                     description="While these fire, the controller (trainwatch run or the "
                                 "webhook receiver) acts: restart, roll back, checkpoint. "
                                 "Each action is journaled (action_taken / action_skipped).",
                     w=9)
    b.timeseries("Restarts and restart guard",
                 target(f"max by (run) ({b.sel('trainwatch_rank_restarts')})", "restarts"),
                 target(b.sel("trainwatch_action_restart_guard_tripped"), "restart guard"),
                 target(f"max by (run, kind) "
                        f"({b.increase('trainwatch_train_restarts_total')})",
                        "restarted by {{kind}}"),
                 description="Restarts of the current rank processes (torchrun's count); "
                             "restarts the journal records, by torchrun or by the controller; "
                             "and the guard, which goes to 1 when the controller stops "
                             "restarting a job that makes no progress.",
                 alerts=("TrainingRestartLoop",), w=6)
    b.timeseries("Alerts fired",
                 target(f"sum by (severity) (max by (run, alertname, severity) "
                        f"({b.increase('trainwatch_alert_fired_total')}))", "{{severity}}"),
                 target(f"max by (run, alertname) "
                        f"({b.increase('trainwatch_alert_fired_total')}) > 0", "{{alertname}}"),
                 description="Alerts the embedded engine fired for this job (alert_firing in "
                             "its journal), by severity and by alert; alerts Prometheus and "
                             "Alertmanager fire are the annotations and the table above.",
                 w=12)
    b.timeseries("Automated actions",
                 target(f"max by (run, action) ({b.increase('trainwatch_action_taken_total')})",
                        "taken: {{action}}"),
                 target(f"max by (run, action) "
                        f"({b.increase('trainwatch_action_skipped_total')})",
                        "skipped: {{action}}"),
                 description="What the controller did about firing alerts (action_taken) and "
                             "decided not to do (action_skipped: dry run, rate limit, restart "
                             "guard, duplicate delivery); the reasons are in the journal "
                             "(trainwatch diagnose).", alerts=("TrainingRestartLoop",), w=12)
