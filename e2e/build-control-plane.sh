#!/usr/bin/env bash
# Builds (once per version) the local Kubernetes control plane used by the e2e suite, the
# benchmark and `make run` without a $KUBECONFIG, and prints the directory holding it (the last
# line of stdout; progress goes to stderr). Cached outside the repository, in
# $PPS_CACHE (default ~/.cache/persistent-pod-state)/kubernetes-<version>/bin.
#
#   build-control-plane.sh [current]   kube-apiserver, kube-controller-manager, kube-scheduler and
#                                      kubectl of the exact version pinned in
#                                      e2e/control-plane/kubernetes/go.mod (the k8s.io/kubernetes
#                                      module, its staging modules pinned by replace directives),
#                                      and etcd of the version pinned in
#                                      e2e/control-plane/etcd/go.mod; built from the Go module
#                                      proxy with the machine's Go (go.sum committed).
#   build-control-plane.sh v1.20       the oldest supported version: v1.20.2 from Debian
#                                      bookworm's source package with Debian's Go 1.19, kubectl
#                                      and etcd of the current build.
#   build-control-plane.sh patchcost OUT   the benchmark's `patchcost` (e2e/control-plane/
#                                      kubernetes/patchcost: the API server's own steps on a
#                                      webhook's patch) into OUT, from the current version's
#                                      modules, with the same Go.
#
# A cached build is used only when every binary reports the wanted version.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${PPS_CACHE:-$HOME/.cache/persistent-pod-state}"
WHICH="${1:-current}"

say() { printf '[%s] control plane: %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# pinned MODULE GO_MOD: the exact version GO_MOD requires MODULE at.
pinned() {
  awk -v m="$1" '$1 == m && $2 ~ /^v[0-9]/ {print $2; exit} $1 == "require" && $2 == m {print $3; exit}' "$2"
}

# reports BINARY EXPECTED COMMAND...: true when COMMAND (run on BINARY) prints EXPECTED.
reports() {
  local bin=$1 want=$2
  shift 2
  [[ -x $bin ]] && [[ "$("$bin" "$@" 2>/dev/null | head -n 1)" == "$want" ]]
}

# The machine's Go (the Go module proxy's toolchain): never Debian's 1.19 that the v1.20 build
# installs, whatever PATH says; checked against the go directive of the modules.
modern_go() {
  local go need have
  for go in "${PPS_GO:-}" /usr/local/go/bin/go "$(command -v go || true)"; do
    [[ -n $go && -x $go ]] || continue
    need=$(awk '$1 == "go" {print $2; exit}' "$HERE/control-plane/kubernetes/go.mod")
    have=$(GOTOOLCHAIN=local "$go" env GOVERSION | sed 's/^go//')
    if [[ "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -n 1)" == "$need" ]]; then
      echo "$go"
      return 0
    fi
  done
  say "no Go >= $(awk '$1 == "go" {print $2; exit}' "$HERE/control-plane/kubernetes/go.mod") found (set PPS_GO)"
  return 1
}

# Only the registry: the configured module proxy, never a direct VCS fetch; go.sum is checked
# and never rewritten.
go_env() {
  local proxy
  proxy=$(GOTOOLCHAIN=local "$GO" env GOPROXY)
  proxy=${proxy//,direct/}
  proxy=${proxy//|direct/}
  [[ -n $proxy && $proxy != direct && $proxy != off ]] || proxy=https://proxy.golang.org
  export GOTOOLCHAIN=local GOPROXY="$proxy" GOFLAGS="-mod=readonly -buildvcs=false" CGO_ENABLED=0
}

KUBE_MOD="$HERE/control-plane/kubernetes/go.mod"
ETCD_MOD="$HERE/control-plane/etcd/go.mod"
KUBE_VERSION=$(pinned k8s.io/kubernetes "$KUBE_MOD")
ETCD_VERSION=$(pinned go.etcd.io/etcd/server/v3 "$ETCD_MOD")
CURRENT_BIN="$CACHE/kubernetes-$KUBE_VERSION/bin"

# built_ok DIR VERSION: DIR holds the control plane of Kubernetes VERSION, with the current
# build's kubectl and etcd.
built_ok() {
  local b
  for b in kube-apiserver kube-controller-manager kube-scheduler; do
    reports "$1/$b" "Kubernetes $2" --version || return 1
  done
  reports "$1/kubectl" "Client Version: $KUBE_VERSION" version --client || return 1
  reports "$1/etcd" "etcd Version: ${ETCD_VERSION#v}" --version
}

current_ok() { built_ok "$CURRENT_BIN" "$KUBE_VERSION"; }

# build_current: the current control plane into $CURRENT_BIN (etcd beside it).
build_current() {
  if current_ok; then
    say "Kubernetes $KUBE_VERSION and etcd $ETCD_VERSION present in $CURRENT_BIN"
    return 0
  fi
  GO=$(modern_go)
  go_env
  local out major minor started
  out=$(mktemp -d "$CACHE/build-$KUBE_VERSION.XXXXXX")
  major=${KUBE_VERSION#v}
  minor=${major#*.}
  minor=${minor%%.*}
  major=${major%%.*}
  # As the project's own release build stamps them (hack/lib/version.sh).
  local flags=(-s -w) key val
  for kv in "gitVersion=$KUBE_VERSION" "gitMajor=$major" "gitMinor=$minor" "gitTreeState=clean" \
    "buildDate=1970-01-01T00:00:00Z"; do
    key=${kv%%=*} val=${kv#*=}
    flags+=("-X" "k8s.io/client-go/pkg/version.$key=$val" "-X" "k8s.io/component-base/version.$key=$val")
  done
  say "building Kubernetes $KUBE_VERSION with $("$GO" env GOVERSION) from $GOPROXY (about 6 minutes on 2 cores the first time)"
  (
    cd "$HERE/control-plane/kubernetes"
    say "downloading the modules of go.mod (checked against the committed go.sum)"
    "$GO" mod download
    local i=0 cmd
    for cmd in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
      i=$((i + 1))
      started=$(date +%s)
      say "[$i/5] $cmd"
      "$GO" build -trimpath -ldflags "${flags[*]}" -o "$out/$cmd" "k8s.io/kubernetes/cmd/$cmd"
      say "[$i/5] $cmd built in $(($(date +%s) - started)) s"
    done
  )
  (
    cd "$HERE/control-plane/etcd"
    started=$(date +%s)
    say "[5/5] etcd $ETCD_VERSION"
    "$GO" mod download
    "$GO" build -trimpath -ldflags "-s -w" -o "$out/etcd" go.etcd.io/etcd/server/v3
    say "[5/5] etcd built in $(($(date +%s) - started)) s"
  )
  rm -rf "$CURRENT_BIN"
  mkdir -p "$(dirname "$CURRENT_BIN")"
  mv "$out" "$CURRENT_BIN"
  current_ok || {
    say "the build in $CURRENT_BIN does not report Kubernetes $KUBE_VERSION / etcd $ETCD_VERSION"
    return 1
  }
  say "Kubernetes $KUBE_VERSION and etcd $ETCD_VERSION installed in $CURRENT_BIN"
}

# Debian bookworm's source package of Kubernetes v1.20.2 (the oldest supported version).
LEGACY_VERSION=v1.20.2
LEGACY_SRC_VERSION="1.20.5+really1.20.2-1.1+deb12u1"
LEGACY_BIN="$CACHE/kubernetes-$LEGACY_VERSION/bin"

# kubectl and etcd there are the current build's (a symlink each).
legacy_ok() { built_ok "$LEGACY_BIN" "$LEGACY_VERSION"; }

build_legacy() {
  build_current
  if legacy_ok; then
    say "Kubernetes $LEGACY_VERSION present in $LEGACY_BIN"
    return 0
  fi
  local sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  say "building Kubernetes $LEGACY_VERSION from Debian's source package with Debian's Go 1.19 (about 6 minutes)"
  # Debian's source packages need a deb-src entry.
  local src_list=/etc/apt/sources.list.d/pps-deb-src.sources
  if [[ ! -f $src_list ]]; then
    $sudo tee "$src_list" >/dev/null <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  fi
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends \
    golang-1.19-go rsync dpkg-dev make golang-github-modern-go-reflect2-dev >/dev/null
  local work="$CACHE/build-$LEGACY_VERSION"
  mkdir -p "$work"
  cd "$work"
  # Pinned: a machine whose deb-src also lists a newer suite would otherwise fetch that suite's
  # kubernetes source, which no longer builds the control plane (it is kubectl only).
  if ! ls -d kubernetes-*/ >/dev/null 2>&1; then
    say "fetching the source package kubernetes=$LEGACY_SRC_VERSION"
    apt-get source -qq "kubernetes=$LEGACY_SRC_VERSION" >/dev/null
  fi
  local src
  src="$(cd "$(ls -d kubernetes-*/ | head -n1)" && pwd)"
  # The vendored reflect2 1.0.1 segfaults under Go >= 1.18: use Debian's 1.0.2 source instead.
  local r2=/usr/share/gocode/src/github.com/modern-go/reflect2
  rm -rf "$src/vendor/github.com/modern-go/reflect2"
  mkdir -p "$src/vendor/github.com/modern-go/reflect2"
  cp -a "$r2"/. "$src/vendor/github.com/modern-go/reflect2/"
  local gopath="$work/.go"
  mkdir -p "$gopath/src/k8s.io"
  ln -sfn "$src" "$gopath/src/k8s.io/kubernetes"
  cd "$gopath/src/k8s.io/kubernetes"
  say "compiling kube-apiserver, kube-controller-manager and kube-scheduler $LEGACY_VERSION"
  # Debian's Go 1.19 first on PATH: this tree does not build with a newer Go (its build keeps
  # its cache beside the sources: hack/lib/golang.sh sets GOCACHE).
  PATH="/usr/lib/go-1.19/bin:$PATH" GOTOOLCHAIN=local GO111MODULE=off GOPATH="$gopath" \
    CGO_ENABLED=0 GOFLAGS="" KUBE_GIT_VERSION="$LEGACY_VERSION" KUBE_GIT_TREE_STATE=clean \
    make WHAT="cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler" >&2
  rm -rf "$LEGACY_BIN"
  mkdir -p "$LEGACY_BIN"
  local b
  for b in kube-apiserver kube-controller-manager kube-scheduler; do
    install -m 0755 "_output/bin/$b" "$LEGACY_BIN/$b"
  done
  ln -sfn "$CURRENT_BIN/kubectl" "$LEGACY_BIN/kubectl"
  ln -sfn "$CURRENT_BIN/etcd" "$LEGACY_BIN/etcd"
  legacy_ok || {
    say "the build in $LEGACY_BIN does not report Kubernetes $LEGACY_VERSION"
    return 1
  }
  say "Kubernetes $LEGACY_VERSION installed in $LEGACY_BIN"
}

mkdir -p "$CACHE"
case "$WHICH" in
  current)
    build_current
    echo "$CURRENT_BIN"
    ;;
  v1.20)
    build_legacy
    echo "$LEGACY_BIN"
    ;;
  patchcost)
    GO=$(modern_go)
    go_env
    (cd "$HERE/control-plane/kubernetes" && "$GO" build -o "${2:?patchcost OUT}" ./patchcost)
    echo "$2"
    ;;
  *)
    say "unknown version $WHICH (current, v1.20 or patchcost OUT)"
    exit 2
    ;;
esac
