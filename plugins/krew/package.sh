#!/usr/bin/env bash
# Packages the binary as the krew plugin `pps`: OUT_DIR/kubectl-pps-VERSION-linux-amd64.tar.gz
# (the binary named kubectl-pps) and OUT_DIR/pps.yaml, plugins/krew/pps.yaml with the archive's
# sha256 filled in.
#
#   plugins/krew/package.sh target/release/persistent-pod-state dist/
set -euo pipefail
binary=${1:?usage: package.sh BINARY OUT_DIR}
out=${2:?usage: package.sh BINARY OUT_DIR}
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
version=$(awk '$1 == "version:" {print $2; exit}' "$here/pps.yaml")
mkdir -p "$out"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
install -m 0755 "$binary" "$stage/kubectl-pps"
archive="$out/kubectl-pps-$version-linux-amd64.tar.gz"
# Reproducible: fixed owner, order and times.
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$stage" -cf - kubectl-pps | gzip -n >"$archive"
sum=$(sha256sum "$archive" | cut -d' ' -f1)
sed "s/sha256: SHA256/sha256: $sum/" "$here/pps.yaml" >"$out/pps.yaml"
echo "$archive"
