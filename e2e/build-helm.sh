#!/usr/bin/env bash
# Builds (once per version) the helm used by `make chart` and the e2e suite, and prints its path
# (the last line of stdout; progress goes to stderr): helm.sh/helm/v3 at the exact version
# e2e/control-plane/helm/go.mod requires, from the Go module proxy with the machine's Go (go.sum
# committed, never rewritten), stamped as Helm's own release build stamps it. Cached in
# $PPS_CACHE (default ~/.cache/persistent-pod-state)/helm-<version>/bin/helm and used only when
# it reports that version.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${PPS_CACHE:-$HOME/.cache/persistent-pod-state}"
MOD="$HERE/control-plane/helm/go.mod"

say() { printf '[%s] helm: %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

pinned() { awk -v m="$1" '$1 == m && $2 ~ /^v[0-9]/ {print $2; exit}' "$MOD"; }

VERSION=$(pinned helm.sh/helm/v3)
BIN="$CACHE/helm-$VERSION/bin/helm"

if [[ -x $BIN && "$("$BIN" version --template '{{.Version}}' 2>/dev/null)" == "$VERSION" ]]; then
  say "helm $VERSION present in $BIN"
  echo "$BIN"
  exit 0
fi

GO=""
for go in "${PPS_GO:-}" /usr/local/go/bin/go "$(command -v go || true)"; do
  [[ -n $go && -x $go ]] && GO=$go && break
done
[[ -n $GO ]] || { say "no Go found (set PPS_GO)"; exit 1; }
proxy=$(GOTOOLCHAIN=local "$GO" env GOPROXY)
proxy=${proxy//,direct/}
proxy=${proxy//|direct/}
[[ -n $proxy && $proxy != direct && $proxy != off ]] || proxy=https://proxy.golang.org
export GOTOOLCHAIN=local GOPROXY="$proxy" GOFLAGS="-mod=readonly -buildvcs=false" CGO_ENABLED=0

# The Kubernetes version helm assumes without a cluster: its client-go's, as Helm's Makefile sets.
k8s=$(pinned k8s.io/client-go)
k8s_minor=${k8s#v0.}
k8s_minor=${k8s_minor%%.*}
flags="-s -w -X helm.sh/helm/v3/internal/version.version=$VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
  flags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$k8s_minor"
done

say "building helm $VERSION with $("$GO" env GOVERSION) from $GOPROXY (about a minute on 2 cores)"
out=$(mktemp -d)
(
  cd "$HERE/control-plane/helm"
  "$GO" build -trimpath -ldflags "$flags" -o "$out/helm" helm.sh/helm/v3/cmd/helm
)
mkdir -p "$(dirname "$BIN")"
mv "$out/helm" "$BIN"
rmdir "$out"
[[ "$("$BIN" version --template '{{.Version}}')" == "$VERSION" ]] || {
  say "the build in $BIN does not report $VERSION"
  exit 1
}
say "helm $VERSION installed in $BIN"
echo "$BIN"
