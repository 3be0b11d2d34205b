#!/usr/bin/env bash
# The main job (`make run`): runs persistent-pod-state in the foreground against the cluster in
# $KUBECONFIG, or, when $KUBECONFIG is unset, against a fresh local control plane with 4
# fake-kubelet nodes in 2 zones. Installs the CRD and registers the pod webhook first; on exit
# (Ctrl-C) unregisters the webhook and stops the local control plane.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

export ETCD_PORT="${ETCD_PORT:-2379}" APISERVER_PORT="${APISERVER_PORT:-6443}"
export WEBHOOK_PORT="${WEBHOOK_PORT:-9443}" PROBE_PORT="${PROBE_PORT:-8080}"
cd "$ROOT"
cargo build --locked --features e2e --bins

LOCAL=0
if [[ -z ${KUBECONFIG:-} ]]; then
  LOCAL=1
  export CLUSTER_DIR="${CLUSTER_DIR:-$CACHE/local-cluster}"
  rm -rf "$CLUSTER_DIR"
else
  export CLUSTER_DIR="${CLUSTER_DIR:-$(mktemp -d /tmp/pps-run.XXXXXX)}"
  mkdir -p "$CLUSTER_DIR/logs"
  # The cluster's own: only kubectl is needed, the machine's, or the local control plane's.
  command -v kubectl >/dev/null || control_plane_bin
fi

SERVE_PID=""
on_exit() {
  [[ -n $SERVE_PID ]] && kill -TERM "$SERVE_PID" 2>/dev/null && wait "$SERVE_PID" 2>/dev/null
  unregister_webhook
  if ((LOCAL)); then cluster_down; fi
}
trap on_exit EXIT
trap 'exit 130' INT TERM

if ((LOCAL)); then
  cluster_up
  nodes_up
  log "local control plane up: export KUBECONFIG=$KUBECONFIG to use it"
fi
webhook_certs
install_crd
log "serving (webhook :$WEBHOOK_PORT, probes http://127.0.0.1:$PROBE_PORT/metrics); Ctrl-C stops"
(
  until curl -sf "http://127.0.0.1:$PROBE_PORT/readyz" >/dev/null 2>&1; do sleep 0.5; done
  register_webhook
  log "webhook registered"
) &
PPS_LISTEN="0.0.0.0:$WEBHOOK_PORT" PPS_PROBE_LISTEN="0.0.0.0:$PROBE_PORT" \
  PPS_TLS_CERT="$CLUSTER_DIR/webhook-certs/tls.crt" PPS_TLS_KEY="$CLUSTER_DIR/webhook-certs/tls.key" \
  "$PPS_BIN" serve &
SERVE_PID=$!
wait "$SERVE_PID"
