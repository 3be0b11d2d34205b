#!/usr/bin/env bash
# The benchmark (issue 11), one command: `bash bench/run.sh` (full: about 15 minutes, see
# BENCHMARKS.md) or `bash bench/run.sh --short` (CI: every figure produced, at smaller sizes and
# shorter; nothing is asserted about time). Prints one table per part:
#   1. admission over HTTPS against a bare axum+rustls baseline (bench-https)
#   2. the decision in process at 1, 1,000 (and 100,000) PersistentPodStates (cargo bench)
#   3-5. through a local control plane (bench-cluster): pod CREATE latency with and without
#      the webhook, the controller under a StatefulSet becoming Ready, memory at scale
# With FLAMEGRAPH=FILE.svg (needs perf; installs inferno, pinned, when missing), one more HTTPS
# run of ours is profiled by `perf record` and drawn as a flame graph into FILE.svg.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

mode=()
[[ ${1:-} == --short ]] && mode=(--short)

cargo build --release --locked --features bench,e2e --bins
INFERNO_VERSION=0.12.3
perf_args=()
if [[ -n ${FLAMEGRAPH:-} ]]; then
  command -v perf >/dev/null || { echo "FLAMEGRAPH needs perf (linux-perf)" >&2; exit 1; }
  inferno-flamegraph --version 2>/dev/null | grep -q "$INFERNO_VERSION" ||
    cargo install --locked inferno --version "$INFERNO_VERSION"
  perf_data=$(mktemp /tmp/bench-https-perf.XXXXXX)
  perf_args=(--perf "$perf_data")
fi
./target/release/bench-https "${mode[@]}" "${perf_args[@]}"
if [[ -n ${FLAMEGRAPH:-} ]]; then
  perf script -i "$perf_data" 2>/dev/null | inferno-collapse-perf | \
    inferno-flamegraph --title "persistent-pod-state: admission over HTTPS (bench-server under bench-https)" >"$FLAMEGRAPH"
  rm -f "$perf_data"
  echo "flame graph: $FLAMEGRAPH"
fi

echo
echo "The admission decision in process (issue 11.2), µs per pod:"
echo
cargo bench --locked --features bench --bench admission -- "${mode[@]}"

# A control plane of its own (ports apart from the e2e suite's), release binaries, 8 nodes
# (880 pod slots), and one `serve` replica registered as the manifests ship the webhook.
export CLUSTER_DIR="${CLUSTER_DIR:-$(mktemp -d /tmp/pps-bench.XXXXXX)}"
export ETCD_PORT=22379 APISERVER_PORT=26443 WEBHOOK_PORT=29443
PROBE_PORT=28080
PPS_BIN="$ROOT/target/release/persistent-pod-state"
KUBELET_BIN="$ROOT/target/release/fake-kubelet"
LB_BIN="$ROOT/target/release/loopback-lb"
source "$ROOT/e2e/lib.sh"
on_exit() {
  local rc=$?
  if ((rc != 0)); then
    for f in "$CLUSTER_DIR"/logs/persistent-pod-state-*.log "$CLUSTER_DIR"/logs/bench-memory-*.log; do
      [[ -f $f ]] && { echo "--- last lines of $f"; tail -n 30 "$f"; }
    done
  fi
  stop_bg bench-baseline
  cluster_down
  exit "$rc"
}
trap on_exit EXIT

cluster_up
# The bare webhook of 11.3 (what calling any webhook costs the API server).
start_bg bench-baseline "$ROOT/target/release/bench-baseline" --listen 127.0.0.1:29500 \
  --cert-dir "$CLUSTER_DIR/baseline-certs"
mapfile -t bench_nodes < <(kubelet_args)
for n in a1 a2 a3 a4 b1 b2 b3 b4; do bench_nodes+=(--node "bench-$n=zone-${n:0:1}"); done
start_bg fake-kubelet "$KUBELET_BIN" "${bench_nodes[@]}"
wait_until 60 "8 ready nodes" bash -c \
  "[[ \$(kubectl get nodes -o jsonpath='{range .items[*]}{.status.conditions[?(@.type==\"Ready\")].status}{\"\\n\"}{end}' | grep -c '^True$') -eq 8 ]]"
webhook_certs
install_crd
service_account
serve_replica a "$WEBHOOK_PORT" "$PROBE_PORT"
register_webhook

./target/release/bench-cluster "${mode[@]}" --probe "127.0.0.1:$PROBE_PORT" \
  --serve-pid "$(cat "$CLUSTER_DIR/persistent-pod-state-a.pid")" --serve-bin "$PPS_BIN" \
  --cluster-dir "$CLUSTER_DIR" --baseline-addr 127.0.0.1:29500 \
  --baseline-ca "$CLUSTER_DIR/baseline-certs/ca.crt"
