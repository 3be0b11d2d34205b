#!/usr/bin/env bash
# restart.sh [--kill] NAME [DOWN_SECONDS]: a fault for the e2e suite. Stops a process that
# e2e/lib.sh started in $CLUSTER_DIR (SIGTERM, or SIGKILL with --kill), keeps it down for
# DOWN_SECONDS (the length of the outage), then starts it again with the command it was started
# with. Prints nothing; the caller polls for recovery.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
: "${CLUSTER_DIR:?CLUSTER_DIR is not set}"

kill_it=false
if [[ ${1:-} == --kill ]]; then
  kill_it=true
  shift
fi
name=${1:?usage: restart.sh [--kill] NAME [DOWN_SECONDS]}
down=${2:-0}
cmd="$CLUSTER_DIR/$name.cmd"
[[ -f $cmd ]] || { echo "no command recorded for $name in $CLUSTER_DIR" >&2; exit 1; }

if $kill_it; then
  pid=$(cat "$CLUSTER_DIR/$name.pid")
  kill -KILL "$pid" 2>/dev/null || true
  while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
  rm -f "$CLUSTER_DIR/$name.pid"
else
  stop_bg "$name"
fi
# The outage itself: how long the component stays down (a fault, not a synchronisation).
sleep "$down"
eval "start_bg $(printf '%q' "$name") $(cat "$cmd")"
# When each component came back (seconds since the epoch), for run.sh's RBAC check.
echo "$name $(date -u +%s)" >>"$CLUSTER_DIR/restarts.log"
