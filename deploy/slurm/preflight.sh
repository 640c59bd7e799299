#!/usr/bin/env bash
# Slurm Prolog (runs as root on each allocated node before the job starts): is this node
# fit to run the job?  `trainwatch preflight` checks GPUs (NVML), storage, host limits and
# leftover processes, network and versions (docs/preflight.md).  When a check fails, this
# script drains the node with the failed checks as the reason and exits non-zero, so Slurm
# requeues the job instead of starting it on a bad node.  A bad preflight config or a
# broken trainwatch never drains a node: that is logged and the job starts.
#   slurm.conf:  Prolog=/etc/slurm/trainwatch/preflight.sh   (or call it from your prolog)
# Settings (slurmd's environment):
#   TRAINWATCH_PREFLIGHT_CONFIG  thresholds, e.g. gpu.expect_count (default /etc/trainwatch/preflight.yaml)
#   TRAINWATCH_PREFLIGHT_ARGS    more options, e.g. "--xid-watch 5 --peer storage1:2049"
#   TRAINWATCH_RUNS_ROOT         checked for space and writes (the run dirs go below it)
set -uo pipefail
TRAINWATCH="${TRAINWATCH_BIN:-/usr/local/bin/trainwatch}"
PYTHON="${TRAINWATCH_PYTHON:-python3}"
SCONTROL="${SCONTROL:-scontrol}"
CONFIG="${TRAINWATCH_PREFLIGHT_CONFIG:-/etc/trainwatch/preflight.yaml}"
RUNS_ROOT="${TRAINWATCH_RUNS_ROOT:-/var/lib/trainwatch/runs}"
LOG_DIR="${TRAINWATCH_PREFLIGHT_LOG_DIR:-/var/log/trainwatch}"
TIMEOUT="${TRAINWATCH_PREFLIGHT_TIMEOUT:-180}"
: "${SLURM_JOB_ID:?not running under Slurm}"
node="${SLURMD_NODENAME:-$(hostname -s)}"

mkdir -p "$RUNS_ROOT" "$LOG_DIR"
report="$LOG_DIR/preflight-$SLURM_JOB_ID.json"
args=(preflight --json --run-dir "$RUNS_ROOT")
[ -f "$CONFIG" ] && args+=(--config "$CONFIG")
# shellcheck disable=SC2206  # word splitting of the extra options is intended
args+=(${TRAINWATCH_PREFLIGHT_ARGS:-})

timeout "$TIMEOUT" "$TRAINWATCH" "${args[@]}" >"$report" 2>"$report.err"
rc=$?
case "$rc" in
    0)
        exit 0 ;;
    1)
        failed=$("$PYTHON" -c 'import json, sys
checks = json.load(open(sys.argv[1]))["checks"]
print(" ".join(c["id"] for c in checks if c["status"] == "fail") or "warnings (--strict)")' \
            "$report" 2>/dev/null || echo "see $report")
        reason="trainwatch preflight: ${failed:0:180} (job $SLURM_JOB_ID)" ;;
    124)
        reason="trainwatch preflight timed out after ${TIMEOUT}s (hung filesystem or driver?)" ;;
    *)
        echo "trainwatch preflight could not run (exit $rc, see $report.err); node not drained" >&2
        exit 0 ;;
esac
echo "$reason; draining $node" >&2
"$SCONTROL" update NodeName="$node" State=DRAIN Reason="$reason"
exit 1
