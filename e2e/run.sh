#!/usr/bin/env bash
# Runs the end-to-end suite: builds what is needed (the control plane once per version, cached;
# PPS_KUBERNETES picks the version, see lib.sh), starts a fresh local control plane with 4 fake-kubelet nodes in 2 zones (and 3 Calico-like ones), the webhook server, registers
# the webhook, runs `cargo test --features e2e --test e2e`, and tears everything down. Arguments
# are passed to the test binary (e.g. `bash e2e/run.sh migration` runs the tests matching it).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

export CLUSTER_DIR="${CLUSTER_DIR:-$(mktemp -d /tmp/pps-e2e.XXXXXX)}"
export ETCD_PORT="${ETCD_PORT:-12379}" APISERVER_PORT="${APISERVER_PORT:-16443}"
export WEBHOOK_PORT="${WEBHOOK_PORT:-19440}"
export REPLICAS="${REPLICAS:-a=19443:18080 b=19444:18081}"
# Short, so that the release of pods stranded on a lost node is seen within a test.
export NODE_LOST_AFTER="${NODE_LOST_AFTER:-45s}"

cd "$ROOT"
cargo build --locked --features e2e --bins
# The release build as the benchmark builds it (the same features, so `make test` builds it
# once): one test starts it, for what only the shipped layout has (the hot code on a huge page).
cargo build --release --locked --features bench,e2e --bin persistent-pod-state
# helm, for the chart's tests (built once at its pinned version).
HELM=$(bash "$ROOT/e2e/build-helm.sh" | tail -n 1)

on_exit() {
  local rc=$?
  if ((rc != 0)); then
    for f in "$CLUSTER_DIR"/logs/persistent-pod-state-*.log "$CLUSTER_DIR"/logs/fake-kubelet*.log; do
      [[ -f $f ]] && { echo "--- last lines of $f"; tail -n 40 "$f"; }
    done
  fi
  cluster_down
  exit "$rc"
}
trap on_exit EXIT

cluster_up
nodes_up
webhook_certs
install_crd
service_account
serve_up
E2E_CUSTOM_KIND=1 register_webhook
log "control plane ($("$KBIN/kube-apiserver" --version)), fake kubelet and 2 webhook replicas are up; running the e2e suite"

E2E_CLUSTER_DIR="$CLUSTER_DIR" E2E_REPLICAS="$REPLICAS" E2E_LEASE_DURATION="${LEASE_DURATION:-8}" \
  E2E_NODE_LOST_AFTER="$NODE_LOST_AFTER" \
  E2E_WEBHOOK_URL="https://$WEBHOOK_HOST:$WEBHOOK_PORT" E2E_PPS_BIN="$PPS_BIN" \
  E2E_RELEASE_BIN="$ROOT/target/release/persistent-pod-state" \
  E2E_SA_KUBECONFIG="$CLUSTER_DIR/sa-kubeconfig" E2E_HELM="$HELM" E2E_LB_BIN="$LB_BIN" \
  E2E_ETCD_URL="http://127.0.0.1:$ETCD_PORT" \
  cargo test --locked --features e2e --test e2e -- --test-threads 1 --nocapture "$@"

# The replicas ran as the manifests' ServiceAccount throughout: it was refused nothing (a 403
# for content in a namespace being deleted is the namespace's, not RBAC's).
refused=$(grep -hi "forbidden" "$CLUSTER_DIR"/logs/persistent-pod-state-[ab]*.log | grep -v "being terminated" || true)
# A restarted API server (the faults tests restart it) serves before its authorizer's caches
# have synced and refuses everyone for a moment; the replicas retry. A 403 logged within 20 s
# after a restart of the API server is that, not the ServiceAccount's RBAC.
if [[ -n $refused && -f $CLUSTER_DIR/restarts.log ]]; then
  mapfile -t restarts < <(awk '$1 == "kube-apiserver" {print $2}' "$CLUSTER_DIR/restarts.log")
  kept=() warming=0
  while IFS= read -r line; do
    at=$(date -u -d "${line%%Z *}Z" +%s 2>/dev/null || echo 0)
    during=false
    for r in "${restarts[@]}"; do
      if ((at >= r - 1 && at <= r + 20)); then during=true; fi
    done
    if $during; then warming=$((warming + 1)); else kept+=("$line"); fi
  done <<<"$refused"
  if ((warming > 0)); then log "$warming refusal(s) logged while a restarted API server's authorizer synced (not RBAC)"; fi
  refused=$(printf '%s\n' "${kept[@]+"${kept[@]}"}")
  refused=${refused%$'\n'}
fi
if [[ -n $refused ]]; then
  log "the ServiceAccount was refused something:"
  printf '%s\n' "$refused" | head -n 20 >&2
  exit 1
fi
log "the replicas, as the manifests' ServiceAccount, were refused nothing"
