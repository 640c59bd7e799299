#!/usr/bin/env bash
# Slurm Prolog (runs as root on each allocated node before the job starts):
# create the job's run directory where the node's trainwatch agent discovers it
# (agent config: `discover: [/var/lib/trainwatch/runs]`).
#   slurm.conf:  Prolog=/etc/slurm/trainwatch/prolog.sh
#                TaskProlog=/etc/slurm/trainwatch/task_prolog.sh
#                Epilog=/etc/slurm/trainwatch/epilog.sh
set -euo pipefail
RUNS_ROOT="${TRAINWATCH_RUNS_ROOT:-/var/lib/trainwatch/runs}"
: "${SLURM_JOB_ID:?not running under Slurm}"
run_dir="$RUNS_ROOT/slurm-$SLURM_JOB_ID"
mkdir -p "$run_dir"/{status,metrics,checkpoints,diagnostics,control,logs,tmp}
if [ -n "${SLURM_JOB_USER:-}" ] && id "$SLURM_JOB_USER" >/dev/null 2>&1; then
    chown -R "$SLURM_JOB_USER" "$run_dir"
fi
chmod 0755 "$run_dir"
exit 0
