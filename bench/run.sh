#!/usr/bin/env bash
# The benchmark (issues 11 and 22), one command: `bash bench/run.sh` (full: about 35 minutes,
# see BENCHMARKS.md) or `bash bench/run.sh --short` (CI: every figure produced, at smaller sizes
# and shorter; nothing is asserted about time). Prints one table per part:
#   1. the decision in process at 1, 1,000 (and 100,000) PersistentPodStates (cargo bench)
#   2-4. through a local control plane (bench-cluster): pod CREATE latency with no webhook, the
#      floor (bench-floor) and ours; the controller under StatefulSets becoming Ready; memory at
#      scale
#   5. admission over HTTPS (bench-serving): the shipped `serve` of that control plane (its
#      caches hold part 4's objects) against the floor, under oha, and what each layer costs
# With FLAMEGRAPH=FILE.svg (needs perf; installs inferno, pinned, when missing), one more run of
# part 5 is profiled by `perf record` on `serve` and drawn as a flame graph into FILE.svg.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

mode=()
[[ ${1:-} == --short ]] && mode=(--short)
# BENCH_ONLY=api|controller|memory: only that part of bench-cluster (and not the in-process
# decision); the HTTPS part runs after the memory part only (it reviews that part's objects).
only=()
[[ -n ${BENCH_ONLY:-} ]] && only=(--only "$BENCH_ONLY")

cargo build --release --locked --features bench,e2e --bins
# The external load generator, pinned, built from crates.io once per machine.
OHA_VERSION=1.16.0
OHA_ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/persistent-pod-state/oha-$OHA_VERSION"
OHA="$OHA_ROOT/bin/oha"
if ! "$OHA" --version 2>/dev/null | grep -qx "oha $OHA_VERSION"; then
  echo "bench: building oha $OHA_VERSION (once per machine, a few minutes)"
  cargo install --locked oha --version "$OHA_VERSION" --root "$OHA_ROOT"
fi
INFERNO_VERSION=0.12.3
perf_args=()
if [[ -n ${FLAMEGRAPH:-} ]]; then
  command -v perf >/dev/null || { echo "FLAMEGRAPH needs perf (linux-perf)" >&2; exit 1; }
  inferno-flamegraph --version 2>/dev/null | grep -q "$INFERNO_VERSION" ||
    cargo install --locked inferno --version "$INFERNO_VERSION"
  perf_data=$(mktemp /tmp/bench-serving-perf.XXXXXX)
  perf_args=(--perf "$perf_data")
  # perf names no function of the code serve runs from a huge page (src/hot_code.rs): the
  # replica keeps its code as mapped for the whole run.
  export PPS_HOT_CODE_HUGE_PAGE=false
  echo "bench: FLAMEGRAPH: serve runs without its hot code on a huge page (PPS_HOT_CODE_HUGE_PAGE=false)"
fi

if [[ -z ${BENCH_ONLY:-} ]]; then
  echo
  echo "The admission decision in process (issue 11.2), µs per pod:"
  echo
  cargo bench --locked --features bench --bench admission -- "${mode[@]}"
fi

# A control plane of its own (ports apart from the e2e suite's), release binaries, fake-kubelet
# nodes, and one `serve` replica registered as the manifests ship the webhook.
export CLUSTER_DIR="${CLUSTER_DIR:-$(mktemp -d /tmp/pps-bench.XXXXXX)}"
export ETCD_PORT=22379 APISERVER_PORT=26443 WEBHOOK_PORT=29443
PROBE_PORT=28080
# SERVE_BIN=PATH: another build of the binary as the replica under test (to compare two builds
# in turn); the layout of the one measured is printed either way (link/check.sh).
PPS_BIN="${SERVE_BIN:-$ROOT/target/release/persistent-pod-state}"
bash link/check.sh --report "$PPS_BIN"
KUBELET_BIN="$ROOT/target/release/fake-kubelet"
LB_BIN="$ROOT/target/release/loopback-lb"
source "$ROOT/e2e/lib.sh"
on_exit() {
  local rc=$?
  if ((rc != 0)); then
    for f in "$CLUSTER_DIR"/logs/persistent-pod-state-*.log "$CLUSTER_DIR"/logs/bench-memory*.log; do
      [[ -f $f ]] && { echo "--- last lines of $f"; tail -n 30 "$f"; }
    done
  fi
  stop_bg bench-floor
  cluster_down
  exit "$rc"
}
trap on_exit EXIT

cluster_up
# The bare webhook of part 2 (what calling any webhook costs the API server): the floor.
start_bg bench-floor "$ROOT/target/release/bench-floor" --listen 127.0.0.1:29500 \
  --cert-dir "$CLUSTER_DIR/floor-certs" --cert-host "$WEBHOOK_HOST"
mapfile -t bench_nodes < <(kubelet_args)
# 8 nodes (880 pod slots); the full mode's 2,000 pods of part 3 need 20 (2,200 slots).
node_names=(a1 a2 a3 a4 b1 b2 b3 b4)
((${#mode[@]} == 0)) && node_names=(a{1..10} b{1..10})
for n in "${node_names[@]}"; do bench_nodes+=(--node "bench-$n=zone-${n:0:1}"); done
start_bg fake-kubelet "$KUBELET_BIN" "${bench_nodes[@]}"
wait_until 60 "${#node_names[@]} ready nodes" bash -c \
  "[[ \$(kubectl get nodes -o jsonpath='{range .items[*]}{.status.conditions[?(@.type==\"Ready\")].status}{\"\\n\"}{end}' | grep -c '^True$') -eq ${#node_names[@]} ]]"
webhook_certs
install_crd
service_account
serve_replica a "$WEBHOOK_PORT" "$PROBE_PORT"
register_webhook

./target/release/bench-cluster "${mode[@]}" "${only[@]}" --probe "127.0.0.1:$PROBE_PORT" \
  --serve-pid "$(cat "$CLUSTER_DIR/persistent-pod-state-a.pid")" --serve-bin "$PPS_BIN" \
  --cluster-dir "$CLUSTER_DIR" --baseline-addr "$WEBHOOK_HOST:29500" \
  --baseline-ca "$CLUSTER_DIR/floor-certs/ca.crt"

# Issue 22.2, apart from any webhook: the pinned kube-apiserver's own steps on the bare
# webhook's answer and on ours once answered (e2e/control-plane/kubernetes/patchcost, built from
# the control plane's pinned modules), on the pod the API part created.
if [[ -f $CLUSTER_DIR/pod-as-sent.json ]]; then
  bash e2e/build-control-plane.sh patchcost "$CLUSTER_DIR/patchcost" >/dev/null
  patchcost_size=(-rounds 21 -calls 1000)
  ((${#mode[@]} > 0)) && patchcost_size=(-rounds 5 -calls 200)
  echo
  "$CLUSTER_DIR/patchcost" "${patchcost_size[@]}" "$CLUSTER_DIR/pod-as-sent.json" \
    "bare webhook=$CLUSTER_DIR/bare-patch.json" "bare webhook, our patch=$CLUSTER_DIR/our-patch.json"
fi

# The HTTPS part reviews pod web-1-0 of the memory part's PersistentPodState web-1: its state
# is moved to a node with a kubelet (the memory part's nodes have none, so they count as lost,
# and every review would take the rare path that leaves the pin out and logs a warning).
[[ -n ${BENCH_ONLY:-} && ${BENCH_ONLY:-} != memory ]] && exit 0
kubectl -n ns-1 patch persistentpodstates.apps.kruise.io web-1 --subresource=status --type=merge \
  -p '{"status":{"podStates":{"web-1-0":{"nodeName":"bench-a1","nodeTopologyLabels":{"kubernetes.io/hostname":"bench-a1","topology.kubernetes.io/zone":"zone-a"}}}}}' >/dev/null
./target/release/bench-serving "${mode[@]}" "${perf_args[@]}" --oha "$OHA" \
  --serve-addr "127.0.0.1:$WEBHOOK_PORT" --serve-pid "$(cat "$CLUSTER_DIR/persistent-pod-state-a.pid")"
if [[ -n ${FLAMEGRAPH:-} ]]; then
  perf script -i "$perf_data" 2>/dev/null | c++filt | inferno-collapse-perf | \
    inferno-flamegraph --title "persistent-pod-state serve: admission over HTTPS under oha" >"$FLAMEGRAPH"
  rm -f "$perf_data"
  echo "flame graph: $FLAMEGRAPH"
fi
