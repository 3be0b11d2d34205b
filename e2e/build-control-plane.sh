#!/usr/bin/env bash
# Builds (once) the local Kubernetes control plane used by the e2e suite and by `make run`
# without a $KUBECONFIG: kube-apiserver, kube-controller-manager and kube-scheduler v1.20.2
# from Debian's source package, plus etcd from Debian's etcd-server. The binaries are cached
# outside the repository, in $PPS_CACHE (default ~/.cache/persistent-pod-state).
set -euo pipefail

CACHE="${PPS_CACHE:-$HOME/.cache/persistent-pod-state}"
BIN="$CACHE/bin"
WANT=(kube-apiserver kube-controller-manager kube-scheduler)

have_all() {
  for b in "${WANT[@]}"; do [[ -x "$BIN/$b" ]] || return 1; done
  command -v etcd >/dev/null || [[ -x /usr/bin/etcd ]] || return 1
}

if have_all; then
  echo "control plane binaries present in $BIN"
  exit 0
fi

SUDO=""
[[ $(id -u) -eq 0 ]] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive

# Debian's source packages need a deb-src entry.
SRC_LIST=/etc/apt/sources.list.d/pps-deb-src.sources
if [[ ! -f $SRC_LIST ]]; then
  $SUDO tee "$SRC_LIST" >/dev/null <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
fi
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends \
  golang-go rsync etcd-server dpkg-dev make golang-github-modern-go-reflect2-dev >/dev/null

# etcd-server starts a system etcd on install where an init system runs; we run our own.
$SUDO systemctl disable --now etcd >/dev/null 2>&1 || true

WORK="$CACHE/build"
mkdir -p "$WORK" "$BIN"
cd "$WORK"
# Pinned: a machine whose deb-src also lists a newer suite would otherwise fetch that suite's
# kubernetes source, which no longer builds the control plane (it is kubectl only).
KUBE_SRC_VERSION="1.20.5+really1.20.2-1.1+deb12u1"
if ! ls -d kubernetes-*/ >/dev/null 2>&1; then
  apt-get source -qq "kubernetes=$KUBE_SRC_VERSION" >/dev/null
fi
SRC_DIR="$(cd "$(ls -d kubernetes-*/ | head -n1)" && pwd)"

# The vendored reflect2 1.0.1 segfaults under Go >= 1.18: use Debian's 1.0.2 source instead.
R2=/usr/share/gocode/src/github.com/modern-go/reflect2
rm -rf "$SRC_DIR/vendor/github.com/modern-go/reflect2"
mkdir -p "$SRC_DIR/vendor/github.com/modern-go/reflect2"
cp -a "$R2"/. "$SRC_DIR/vendor/github.com/modern-go/reflect2/"

GOPATH_DIR="$WORK/.go"
mkdir -p "$GOPATH_DIR/src/k8s.io"
ln -sfn "$SRC_DIR" "$GOPATH_DIR/src/k8s.io/kubernetes"

cd "$GOPATH_DIR/src/k8s.io/kubernetes"
GO111MODULE=off GOPATH="$GOPATH_DIR" CGO_ENABLED=0 GOFLAGS="" \
  make WHAT="cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler"

for b in "${WANT[@]}"; do
  install -m 0755 "_output/bin/$b" "$BIN/$b"
done
echo "control plane binaries installed in $BIN"
