#!/usr/bin/env bash
# Re-pins the local control plane to other exact versions (a maintainer's command, not run by the
# tests): rewrites kubernetes/go.mod for k8s.io/kubernetes KUBE_VERSION, with a replace directive
# pinning each staging module its own go.mod requires at v0.0.0 to the matching v0.X.Y, and
# etcd/go.mod for go.etcd.io/etcd/server/v3 ETCD_VERSION; then go.sum of each. Commit both.
#
#   e2e/control-plane/pin.sh v1.37.2 v3.6.16
set -euo pipefail
KUBE_VERSION=${1:?usage: pin.sh KUBE_VERSION ETCD_VERSION}
ETCD_VERSION=${2:?usage: pin.sh KUBE_VERSION ETCD_VERSION}
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export GOTOOLCHAIN=local GOFLAGS=-mod=mod
STAGING="v0.${KUBE_VERSION#v1.}"
TOOLS=(kube-apiserver kube-controller-manager kube-scheduler kubectl)

cd "$HERE/kubernetes"
upstream=$(go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')
# The staging modules: what the version's own go.mod requires at the placeholder v0.0.0.
mapfile -t staging < <(awk '$2 == "v0.0.0" {print $1} $1 == "require" && $3 == "v0.0.0" {print $2}' "$upstream" | sort -u)
((${#staging[@]} > 0)) || { echo "no staging modules found in $upstream" >&2; exit 1; }
{
  printf 'module persistent-pod-state.local/control-plane/kubernetes\n\ngo %s\n\n' \
    "$(awk '$1 == "go" {print $2; exit}' "$upstream")"
  printf 'require k8s.io/kubernetes %s\n\nreplace (\n' "$KUBE_VERSION"
  for m in "${staging[@]}"; do printf '\t%s => %s %s\n' "$m" "$m" "$STAGING"; done
  printf ')\n\ntool (\n'
  for t in "${TOOLS[@]}"; do printf '\tk8s.io/kubernetes/cmd/%s\n' "$t"; done
  printf ')\n'
} >go.mod
rm -f go.sum
go mod tidy
echo "kubernetes/go.mod: k8s.io/kubernetes $KUBE_VERSION, ${#staging[@]} staging modules at $STAGING"

cd "$HERE/etcd"
printf 'module persistent-pod-state.local/control-plane/etcd\n\ngo %s\n\ntool go.etcd.io/etcd/server/v3\n\nrequire go.etcd.io/etcd/server/v3 %s\n' \
  "$(awk '$1 == "go" {print $2; exit}' "$HERE/kubernetes/go.mod")" "$ETCD_VERSION" >go.mod
rm -f go.sum
go mod tidy
echo "etcd/go.mod: go.etcd.io/etcd/server/v3 $ETCD_VERSION"
