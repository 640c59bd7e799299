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
AGENT_GROUP="${TRAINWATCH_AGENT_GROUP:-trainwatch}"
mkdir -p "$run_dir"/{status,metrics,checkpoints,diagnostics,control,logs,tmp}
# The job's user owns it; the agent's group reads it (setgid folders keep the group on
# everything the job creates; the job's umask, 027 or 022, keeps files group-readable):
# docs/run-directory.md, "Permissions". Only the job writes, control/ included.
owner="${SLURM_JOB_USER:-root}"
id "$owner" >/dev/null 2>&1 || owner=root
if getent group "$AGENT_GROUP" >/dev/null; then
    chown -R "$owner:$AGENT_GROUP" "$run_dir"
else
    chown -R "$owner" "$run_dir"
fi
find "$run_dir" -type d -exec chmod 2750 {} +
exit 0
