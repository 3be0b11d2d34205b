#!/usr/bin/env bash
# Packages binaries of persistent-pod-state as the krew plugin `pps`: per binary
# OUT_DIR/kubectl-pps-VERSION-linux-ARCH.tar.gz (the binary named kubectl-pps; ARCH, amd64 or
# arm64, read from the binary itself), and OUT_DIR/pps.yaml, plugins/krew/pps.yaml with one
# platform per archive, its arch and sha256 filled in. Prints the archives' paths, in order.
#
#   plugins/krew/package.sh dist/ target/release/persistent-pod-state \
#     target/aarch64-unknown-linux-gnu/release/persistent-pod-state
set -euo pipefail
usage="usage: package.sh OUT_DIR BINARY..."
out=${1:?$usage}
shift
(($# > 0)) || { echo "$usage" >&2; exit 1; }
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
template="$here/pps.yaml"
version=$(awk '$1 == "version:" {print $2; exit}' "$template")
mkdir -p "$out"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
# The manifest up to its platforms, then the platform entry, repeated below per archive.
awk '{print} /^  platforms:$/ {exit}' "$template" >"$stage/pps.yaml"
entry=$(awk 'seen && !/^ *#/ {print} /^  platforms:$/ {seen = 1}' "$template")
declare -A packaged=()
for binary in "$@"; do
  case $(readelf -h "$binary" 2>/dev/null | awk -F: '$1 ~ /Machine/ {gsub(/^ +/, "", $2); print $2}') in
    "Advanced Micro Devices X86-64") arch=amd64 ;;
    AArch64) arch=arm64 ;;
    *) echo "package.sh: $binary is not a linux/amd64 or linux/arm64 binary" >&2; exit 1 ;;
  esac
  [[ -z ${packaged[$arch]:-} ]] || { echo "package.sh: two linux/$arch binaries" >&2; exit 1; }
  packaged[$arch]=1
  rm -rf "$stage/bin" && mkdir "$stage/bin"
  install -m 0755 "$binary" "$stage/bin/kubectl-pps"
  archive="$out/kubectl-pps-$version-linux-$arch.tar.gz"
  # Reproducible: fixed owner, order and times.
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$stage/bin" -cf - kubectl-pps | gzip -n >"$archive"
  sum=$(sha256sum "$archive" | cut -d' ' -f1)
  sed -e "s/ARCH/$arch/g" -e "s/sha256: SHA256/sha256: $sum/" <<<"$entry" >>"$stage/pps.yaml"
  echo "$archive"
done
mv "$stage/pps.yaml" "$out/pps.yaml"
