#!/usr/bin/env bash
# Slurm TaskProlog (runs as the job user before each task): lines printed as
# "export NAME=value" are added to the task's environment, so trainwatch telemetry
# (Telemetry.from_env) writes into the run directory the prolog created.
# One run identity: the run's name is its directory's, slurm-<job id>, in run.json, in
# every series' `run` label and in the receiver (docs/deploy.md, "One name per run").
RUNS_ROOT="${TRAINWATCH_RUNS_ROOT:-/var/lib/trainwatch/runs}"
run="slurm-$SLURM_JOB_ID"
echo "export TRAINWATCH_RUN_DIR=$RUNS_ROOT/$run"
echo "export TRAINWATCH_JOB=$run"
echo "export TMPDIR=$RUNS_ROOT/$run/tmp"
