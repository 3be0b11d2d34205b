#!/usr/bin/env bash
# Shared by e2e/run.sh (the test suite) and e2e/local.sh (the main job): start and stop the
# local control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler), the fake
# kubelet, and persistent-pod-state itself; install the CRD and register the webhook.
#
# Settings (environment):
#   CLUSTER_DIR     state, logs, certificates and kubeconfig of this control plane
#   ETCD_PORT       etcd client port (peer port is ETCD_PORT+1)
#   APISERVER_PORT  kube-apiserver HTTPS port
#   WEBHOOK_HOST    address the API server calls the webhook at (default 0.0.0.0, below)
#   WEBHOOK_PORT    the port the API server calls the webhooks on
#   NODE_LOST_AFTER for serve_up: the replicas' --node-lost-after (default 5m)
#   REPLICAS        for serve_up: NAME=WEBHOOK_PORT:PROBE_PORT of each replica (behind a loopback
#                   load balancer on WEBHOOK_PORT, standing in for a Service)
#   PPS_CACHE       where the control plane binaries are cached (~/.cache/persistent-pod-state)
#   PPS_KUBERNETES  the control plane's version: `current` (default: the exact version pinned in
#                   e2e/control-plane/, built from the Go module proxy) or `v1.20` (the oldest
#                   supported one, from Debian's source package); see e2e/build-control-plane.sh

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${PPS_CACHE:-$HOME/.cache/persistent-pod-state}"
export PPS_KUBERNETES="${PPS_KUBERNETES:-current}"
PPS_BIN="${PPS_BIN:-$ROOT/target/debug/persistent-pod-state}"
# The API server calls a webhook whose URL is loopback (127.0.0.1, localhost) over HTTP/2, and
# every other one, a Service's included, over HTTP/1.1 with keep-alive (`isLocalHost` in
# k8s.io/apiserver/pkg/util/webhook/client.go; v1.20 calls every webhook over HTTP/1.1). The
# webhooks listen on 127.0.0.1 and are registered at 0.0.0.0, which Linux connects to this
# host's loopback and the API server does not count as loopback: it calls them as it calls the
# webhook in a cluster. WEBHOOK_HOST=127.0.0.1: over HTTP/2.
WEBHOOK_HOST="${WEBHOOK_HOST:-0.0.0.0}"
KUBELET_BIN="${KUBELET_BIN:-$ROOT/target/debug/fake-kubelet}"
LB_BIN="${LB_BIN:-$ROOT/target/debug/loopback-lb}"
NODES=(node-a1=zone-a node-a2=zone-a node-b1=zone-b node-b2=zone-b)
# Nodes whose pod network is Calico-like (IP requests honoured on any node): tainted, so only
# pods that tolerate it (the IP tests' StatefulSets) land there.
CALICO_NODES=(node-c1=zone-c node-c2=zone-c node-c3=zone-c)
CALICO_MARK=e2e.persistent-pod-state.io/cni

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# wait_until DEADLINE_SECONDS DESCRIPTION COMMAND...: polls COMMAND until it succeeds.
wait_until() {
  local deadline=$(( $(date +%s) + $1 )) what=$2
  shift 2
  until "$@" >/dev/null 2>&1; do
    if (( $(date +%s) >= deadline )); then
      log "timed out waiting for $what"
      return 1
    fi
    sleep 0.2
  done
}

# start_bg NAME COMMAND...: runs COMMAND in the background, logging to $CLUSTER_DIR/logs/NAME.log
# (appending, so a restart keeps the earlier lines); its pid and command are kept in
# $CLUSTER_DIR/NAME.pid and NAME.cmd (e2e/restart.sh starts it again from them).
start_bg() {
  local name=$1
  shift
  mkdir -p "$CLUSTER_DIR/logs"
  printf '%q ' "$@" >"$CLUSTER_DIR/$name.cmd"
  "$@" >>"$CLUSTER_DIR/logs/$name.log" 2>&1 </dev/null &
  echo $! >"$CLUSTER_DIR/$name.pid"
}

stop_bg() {
  local pidfile="$CLUSTER_DIR/$1.pid"
  [[ -f $pidfile ]] || return 0
  local pid
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    local i
    for i in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
}

install_packages() {
  local missing=()
  command -v curl >/dev/null || missing+=(curl)
  command -v openssl >/dev/null || missing+=(openssl)
  if ((${#missing[@]})); then
    local sudo=""
    [[ $(id -u) -eq 0 ]] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

# control_plane_bin: builds (once per version) the control plane of PPS_KUBERNETES and puts its
# binaries (kubectl and etcd included) first on PATH.
control_plane_bin() {
  KBIN=$(bash "$ROOT/e2e/build-control-plane.sh" "$PPS_KUBERNETES" | tail -n 1)
  export PATH="$KBIN:$PATH"
}

# legacy: true when the control plane is the oldest supported version (v1.20).
legacy() { [[ $PPS_KUBERNETES == v1.20 ]]; }

cluster_up() {
  control_plane_bin
  install_packages
  mkdir -p "$CLUSTER_DIR"/{pki,etcd,logs}
  local pki="$CLUSTER_DIR/pki"
  "$PPS_BIN" certs --out-dir "$pki" --host 127.0.0.1 --host localhost --host kubernetes.default.svc 2>/dev/null
  # Service account tokens are signed with their own key (SEC1 EC format, which v1.20 reads).
  openssl ecparam -name prime256v1 -genkey -noout -out "$pki/sa.key" 2>/dev/null
  local token
  token=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
  echo "$token,admin,admin,system:masters" >"$pki/tokens.csv"
  chmod 600 "$pki/tokens.csv"

  log "starting etcd on 127.0.0.1:$ETCD_PORT"
  start_bg etcd "$KBIN/etcd" --name default --data-dir "$CLUSTER_DIR/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
    --initial-advertise-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
    --initial-cluster "default=http://127.0.0.1:$((ETCD_PORT + 1))"
  wait_until 30 etcd curl -sf "http://127.0.0.1:$ETCD_PORT/health"

  # No endpoint reconciler: the API server listens on loopback only, which newer versions
  # refuse to publish as the `kubernetes` Service's endpoint (nothing here calls it).
  log "starting kube-apiserver on 127.0.0.1:$APISERVER_PORT"
  start_bg kube-apiserver "$KBIN/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$APISERVER_PORT" \
    --tls-cert-file "$pki/tls.crt" --tls-private-key-file "$pki/tls.key" \
    --token-auth-file "$pki/tokens.csv" --authorization-mode RBAC \
    --service-account-issuer https://kubernetes.default.svc \
    --service-account-key-file "$pki/sa.key" --service-account-signing-key-file "$pki/sa.key" \
    --service-cluster-ip-range 10.96.0.0/16 --disable-admission-plugins ServiceAccount \
    --allow-privileged=true --endpoint-reconciler-type none

  KUBECONFIG="$CLUSTER_DIR/kubeconfig"
  export KUBECONFIG
  cat >"$KUBECONFIG" <<KC
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: https://127.0.0.1:$APISERVER_PORT
    certificate-authority: $pki/ca.crt
users:
- name: admin
  user:
    token: $token
contexts:
- name: local
  context: {cluster: local, user: admin}
current-context: local
KC
  chmod 600 "$KUBECONFIG"
  wait_until 90 kube-apiserver kubectl get --raw /readyz

  log "starting kube-controller-manager and kube-scheduler"
  # Every controller but CSR signing and node IPAM (no kubelets of ours need them). The node
  # lifecycle controller watches the fake kubelets' Leases (10 s, renewed every 2.5 s) and marks a
  # node whose kubelet stopped unknown and unreachable after 20 s, tainting it as on a real
  # cluster. On v1.20 it does not run (the tests there mark nothing lost), controllers have
  # other names, and there is still an insecure port of its own, on by default.
  local version_flags=(--node-monitor-grace-period 20s --node-monitor-period 1s)
  local controllers='*,-certificatesigningrequest-signing-controller,-node-ipam-controller'
  if legacy; then
    version_flags=(--port 0)
    controllers='*,-nodelifecycle,-csrsigning,-nodeipam,-cloud-node-lifecycle'
  fi
  start_bg kube-controller-manager "$KBIN/kube-controller-manager" --kubeconfig "$KUBECONFIG" \
    --leader-elect=false "${version_flags[@]}" --secure-port 0 --use-service-account-credentials=false \
    --controllers "$controllers" \
    --root-ca-file "$pki/ca.crt" --service-account-private-key-file "$pki/sa.key"
  local insecure=()
  if legacy; then insecure=(--port 0); fi
  start_bg kube-scheduler "$KBIN/kube-scheduler" --kubeconfig "$KUBECONFIG" \
    --leader-elect=false "${insecure[@]}" --secure-port 0
}

cluster_down() {
  local c
  local c
  for c in "$CLUSTER_DIR"/persistent-pod-state*.pid; do
    [[ -f $c ]] && stop_bg "$(basename "$c" .pid)"
  done
  for c in loopback-lb fake-kubelet fake-kubelet-calico kube-scheduler kube-controller-manager kube-apiserver etcd; do
    stop_bg "$c"
  done
}

# kubelet_args: what every fake kubelet runs with: where a test stops one, and Leases the node
# lifecycle controller's 20 s grace period fits (10 s, renewed every 2.5 s).
kubelet_args() {
  mkdir -p "$CLUSTER_DIR/kubelet"
  # Containers of the project's image in Jobs (the chart's uninstall hook) run the binary.
  printf '%s\n' --control-dir "$CLUSTER_DIR/kubelet" --lease-seconds 10 --run-image "persistent-pod-state=$PPS_BIN"
}

nodes_up() {
  local args=() n
  mapfile -t args < <(kubelet_args)
  for n in "${NODES[@]}"; do args+=(--node "$n"); done
  log "starting the fake kubelet for ${NODES[*]}"
  start_bg fake-kubelet "$KUBELET_BIN" "${args[@]}"
  wait_until 60 "${#NODES[@]} ready nodes" bash -c \
    "[[ \$(kubectl get nodes -l '!$CALICO_MARK' -o jsonpath='{range .items[*]}{.spec.taints}{\"|\"}{.status.conditions[?(@.type==\"Ready\")].status}{\"\\n\"}{end}' | grep -c '^|True$') -eq ${#NODES[@]} ]]"
  mapfile -t args < <(kubelet_args)
  args+=(--ipam calico --node-label "$CALICO_MARK=calico" --node-taint "$CALICO_MARK=calico:NoSchedule")
  for n in "${CALICO_NODES[@]}"; do args+=(--node "$n"); done
  log "starting the Calico-like fake kubelet for ${CALICO_NODES[*]}"
  start_bg fake-kubelet-calico "$KUBELET_BIN" "${args[@]}"
  wait_until 60 "${#CALICO_NODES[@]} ready Calico-like nodes" bash -c \
    "[[ \$(kubectl get nodes -l '$CALICO_MARK=calico' -o jsonpath='{range .items[*]}{.status.conditions[?(@.type==\"Ready\")].status}{\"\\n\"}{end}' | grep -c '^True$') -eq ${#CALICO_NODES[@]} ]]"
}

# install_crd: the CRD, its conversion webhook pointing at WEBHOOK_HOST (needs webhook_certs);
# on v1.20 without its selectable field (that version does not know it; its kubectl refuses it).
install_crd() {
  local older=()
  if legacy; then older=(--without-selectable-fields); fi
  "$PPS_BIN" crd --conversion-url "https://$WEBHOOK_HOST:$WEBHOOK_PORT/convert" \
    --ca-bundle-file "$CLUSTER_DIR/webhook-certs/ca.crt" "${older[@]}" | kubectl apply -f - >/dev/null
  kubectl wait --for condition=established --timeout=60s crd/persistentpodstates.apps.kruise.io >/dev/null
}

# webhook_certs: a CA and serving certificate for WEBHOOK_HOST in $CLUSTER_DIR/webhook-certs,
# and the serving pair laid out as Kubernetes mounts a Secret volume in $CLUSTER_DIR/webhook-tls
# (tls.crt -> ..data/tls.crt, ..data -> ..<version>), so a rotation can swap ..data.
webhook_certs() {
  local hosts=(--host "$WEBHOOK_HOST" --host localhost)
  [[ $WEBHOOK_HOST == 127.0.0.1 ]] || hosts+=(--host 127.0.0.1)
  "$PPS_BIN" certs --out-dir "$CLUSTER_DIR/webhook-certs" "${hosts[@]}" 2>/dev/null
  local vol="$CLUSTER_DIR/webhook-tls"
  mkdir -p "$vol/..v1"
  cp "$CLUSTER_DIR/webhook-certs/tls.crt" "$CLUSTER_DIR/webhook-certs/tls.key" "$vol/..v1/"
  ln -sfn ..v1 "$vol/..data"
  ln -sfn ..data/tls.crt "$vol/tls.crt"
  ln -sfn ..data/tls.key "$vol/tls.key"
}

# service_account: the manifests' namespace, ServiceAccount and RBAC (nothing else), the Lease's
# FlowSchema where the API server serves the base's version (1.29 on), and a kubeconfig with a
# token of that ServiceAccount in $CLUSTER_DIR/sa-kubeconfig: the replicas run with it, so every
# test exercises the controller under exactly the shipped permissions and priority.
service_account() {
  kubectl apply -f "$ROOT/manifests/base/namespace.yaml" -f "$ROOT/manifests/base/rbac.yaml" >/dev/null
  if (($(server_minor) >= 29)); then
    kubectl apply -f "$ROOT/manifests/base/flowschema.yaml" >/dev/null
  fi
  local sa=system:serviceaccount:persistent-pod-state:persistent-pod-state
  # The aggregated ClusterRole is filled in by the controller-manager.
  wait_until 60 "the aggregated ClusterRole" bash -c \
    "[[ \$(kubectl auth can-i list pods --as=$sa -A) == yes ]]"
  local token server
  token=$(kubectl -n persistent-pod-state create token persistent-pod-state --duration=24h)
  server=$(kubectl config view --minify -o jsonpath='{.clusters[0].cluster.server}')
  cat >"$CLUSTER_DIR/sa-kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster: {server: '$server', certificate-authority: '$CLUSTER_DIR/pki/ca.crt'}
users:
- name: persistent-pod-state
  user: {token: '$token'}
contexts:
- name: local
  context: {cluster: local, user: persistent-pod-state}
current-context: local
KC
  chmod 600 "$CLUSTER_DIR/sa-kubeconfig"
}

# serve_replica NAME WEBHOOK_PORT PROBE_PORT: one `serve` replica in the background, until ready,
# as the manifests' ServiceAccount (service_account first).
serve_replica() {
  log "starting persistent-pod-state replica $1 (webhook 127.0.0.1:$2, probes 127.0.0.1:$3)"
  start_bg "persistent-pod-state-$1" env KUBECONFIG="$CLUSTER_DIR/sa-kubeconfig" \
    PPS_LISTEN="127.0.0.1:$2" PPS_PROBE_LISTEN="127.0.0.1:$3" \
    PPS_TLS_CERT="$CLUSTER_DIR/webhook-tls/tls.crt" PPS_TLS_KEY="$CLUSTER_DIR/webhook-tls/tls.key" \
    PPS_SHUTDOWN_DELAY_SECONDS=0 PPS_LEADER_IDENTITY="e2e-$1" PPS_LEASE_NAMESPACE=persistent-pod-state \
    PPS_CUSTOM_WORKLOAD_CONFIG="$CLUSTER_DIR/custom-workloads.yaml" PPS_NODE_LOST_AFTER="${NODE_LOST_AFTER:-5m}" \
    PPS_LEASE_DURATION_SECONDS="${LEASE_DURATION:-8}" PPS_LEASE_RENEW_DEADLINE_SECONDS="${LEASE_RENEW_DEADLINE:-5}" PPS_LEASE_RETRY_PERIOD_SECONDS=1 \
    "$PPS_BIN" serve
  wait_until 60 "replica $1 readiness" curl -sf "http://127.0.0.1:$3/readyz"
}

# serve_up: every replica of REPLICAS, and the loopback load balancer on WEBHOOK_PORT.
serve_up() {
  local r backends=()
  for r in $REPLICAS; do
    local name=${r%%=*} ports=${r#*=}
    serve_replica "$name" "${ports%%:*}" "${ports#*:}"
    backends+=(--backend "127.0.0.1:${ports%%:*}")
  done
  start_bg loopback-lb "$LB_BIN" --listen "127.0.0.1:$WEBHOOK_PORT" "${backends[@]}"
  wait_until 30 "the load balancer" bash -c "exec 3<>/dev/tcp/127.0.0.1/$WEBHOOK_PORT"
}

# server_minor: the API server's minor version (e.g. 37).
server_minor() {
  kubectl get --raw /version | sed -n 's/.*"minor": *"\([0-9]*\).*/\1/p'
}

# register_webhook: the Mutating (pod CREATE) and Validating (PersistentPodState CREATE/UPDATE)
# WebhookConfigurations exactly as the manifests ship them, reached at WEBHOOK_HOST instead of the
# Service: with matchConditions from 1.28, else with the pre-1.28 component. With
# E2E_CUSTOM_KIND=1 (the e2e suite), the custom kind the suite configures is added to the
# matchConditions by docs/install.md's patch, verbatim (its kind, example.com/Ring, is the
# suite's).
register_webhook() {
  local ca dir="$CLUSTER_DIR/registration" url="https://$WEBHOOK_HOST:$WEBHOOK_PORT" manifests
  ca=$(base64 -w0 <"$CLUSTER_DIR/webhook-certs/ca.crt")
  mkdir -p "$dir"
  # kustomize takes components by relative path only.
  manifests=$(realpath --relative-to="$dir" "$ROOT/manifests")
  local components="" kinds=""
  if (($(server_minor) < 28)); then
    components="components:
  - $manifests/components/pre-1.28"
  elif [[ ${E2E_CUSTOM_KIND:-0} == 1 ]]; then
    kinds="
  - target: {kind: MutatingWebhookConfiguration, name: persistent-pod-state}
    patch: |-
$(awk '/^# custom-kinds-example/ {on = 1} on && /^```/ {exit} on {print "      " $0}' "$ROOT/docs/install.md")"
  fi
  cat >"$dir/kustomization.yaml" <<YAML
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - $manifests/base/webhooks.yaml
$components
patches:
  - target: {kind: MutatingWebhookConfiguration, name: persistent-pod-state}
    patch: |-
      - op: replace
        path: /webhooks/0/clientConfig
        value: {url: "$url/mutate-pod", caBundle: "$ca"}
  - target: {kind: ValidatingWebhookConfiguration, name: persistent-pod-state}
    patch: |-
      - op: replace
        path: /webhooks/0/clientConfig
        value: {url: "$url/validate-persistentpodstate", caBundle: "$ca"}$kinds
YAML
  kubectl kustomize --load-restrictor LoadRestrictionsNone "$dir" | kubectl apply -f - >/dev/null
}

unregister_webhook() {
  kubectl delete mutatingwebhookconfiguration persistent-pod-state --ignore-not-found >/dev/null 2>&1 || true
  kubectl delete validatingwebhookconfiguration persistent-pod-state --ignore-not-found >/dev/null 2>&1 || true
}
