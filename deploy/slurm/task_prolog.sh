#!/usr/bin/env bash
# Slurm TaskProlog (runs as the job user before each task): lines printed as
# "export NAME=value" are added to the task's environment, so trainwatch telemetry
# (Telemetry.from_env) writes into the run directory the prolog created.
RUNS_ROOT="${TRAINWATCH_RUNS_ROOT:-/var/lib/trainwatch/runs}"
echo "export TRAINWATCH_RUN_DIR=$RUNS_ROOT/slurm-$SLURM_JOB_ID"
echo "export TRAINWATCH_JOB=${SLURM_JOB_NAME:-slurm}-$SLURM_JOB_ID"
echo "export TMPDIR=$RUNS_ROOT/slurm-$SLURM_JOB_ID/tmp"
