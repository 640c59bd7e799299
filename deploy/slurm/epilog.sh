#!/usr/bin/env bash
# Slurm Epilog (runs as root after the job): move the run directory out of the
# agent's discover folder so its ranks stop being watched (and stop alerting), and
# keep it for `trainwatch diagnose` / `trainwatch report` for a while.
set -euo pipefail
RUNS_ROOT="${TRAINWATCH_RUNS_ROOT:-/var/lib/trainwatch/runs}"
ARCHIVE="${TRAINWATCH_ARCHIVE:-/var/lib/trainwatch/finished}"
KEEP_DAYS="${TRAINWATCH_KEEP_DAYS:-14}"
: "${SLURM_JOB_ID:?not running under Slurm}"
run_dir="$RUNS_ROOT/slurm-$SLURM_JOB_ID"
mkdir -p "$ARCHIVE"
if [ -d "$run_dir" ]; then
    rm -rf "$run_dir/tmp"
    mv "$run_dir" "$ARCHIVE/"
fi
find "$ARCHIVE" -mindepth 1 -maxdepth 1 -type d -name 'slurm-*' -mtime +"$KEEP_DAYS" \
    -exec rm -rf {} +
exit 0
