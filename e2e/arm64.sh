#!/usr/bin/env bash
# The linux/arm64 build of the binary, as the Dockerfile builds it on an arm64 machine, made
# here on x86-64 by cross-compiling and run under QEMU's user-mode emulation.
#
#   bash e2e/arm64.sh build [X86_64_BINARY]
#                                   builds it (the Dockerfile's build command, for the target
#                                   aarch64-unknown-linux-gnu), checks that it is an AArch64
#                                   binary that runs, and prints its path; given the x86-64
#                                   build too, packages both as the krew plugin
#                                   (plugins/krew/package.sh) and checks the manifest and the
#                                   arm64 archive's `kubectl-pps`
#   bash e2e/arm64.sh e2e TESTS...  builds it, then runs those e2e tests (e2e/run.sh) with the
#                                   webhook replicas, and every binary the suite starts as
#                                   persistent-pod-state, on it under emulation
#
# What it needs it installs when missing: Rust's standard library for the target (rustup, at
# the toolchain's own version), and from Debian bookworm's packages, whose suite holds one
# version of each at a time, GCC 12's cross compiler and C library for arm64 (ring compiles C
# and assembly; the binary links with it) and QEMU 7.2's user-mode emulator; other versions are
# refused.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
TARGET=aarch64-unknown-linux-gnu
CROSS_GCC_VERSION=4:12.2.0
QEMU_VERSION=1:7.2+dfsg
SYSROOT=/usr/aarch64-linux-gnu
say() { echo "arm64: $*" >&2; }
fail() { echo "arm64: $*" >&2; exit 1; }

# The version of package $1 if it is installed (not one removed with its configuration kept).
installed_version() {
  dpkg-query -W -f='${Status} ${Version}' "$1" 2>/dev/null | sed -n 's/^install ok installed //p' || true
}
packages() {
  local missing=()
  [[ $(installed_version gcc-aarch64-linux-gnu) == "$CROSS_GCC_VERSION"* ]] || missing+=(gcc-aarch64-linux-gnu)
  [[ -n $(installed_version libc6-dev-arm64-cross) ]] || missing+=(libc6-dev-arm64-cross)
  [[ $(installed_version qemu-user) == "$QEMU_VERSION"* ]] || missing+=(qemu-user)
  if ((${#missing[@]})); then
    local sudo=""
    [[ $(id -u) -eq 0 ]] || sudo="sudo"
    say "installing ${missing[*]} from Debian's packages"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  local gcc qemu
  gcc=$(installed_version gcc-aarch64-linux-gnu) qemu=$(installed_version qemu-user)
  [[ $gcc == "$CROSS_GCC_VERSION"* ]] || fail "gcc-aarch64-linux-gnu $gcc installed, $CROSS_GCC_VERSION wanted"
  [[ $qemu == "$QEMU_VERSION"* ]] || fail "qemu-user $qemu installed, $QEMU_VERSION wanted"
  # Not a package of any registry: rustup fetches it from the Rust project's server, which a
  # machine that reaches only the registries cannot (so this is not part of `make test`).
  rustup target list --installed | grep -qx "$TARGET" || rustup target add "$TARGET" >&2 ||
    fail "Rust's standard library for $TARGET is not installed and rustup could not fetch it"
}

build() {
  packages
  # A target directory of its own, as the image check's (e2e/check-image.sh); set for this
  # build alone (the e2e suite run after it builds into the usual one).
  local dir="${CARGO_TARGET_DIR:-target}/image" build_cmd
  build_cmd=$(sed -n 's/^RUN \(cargo build .*\)$/\1/p' Dockerfile)
  [[ -n $build_cmd ]] || fail "the Dockerfile has no cargo build"
  say "$build_cmd --target $TARGET"
  CARGO_TARGET_DIR=$dir CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
    CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc $build_cmd --target "$TARGET" >&2
  BIN="$(cd "$dir" && pwd)/$TARGET/release/persistent-pod-state"
  readelf -h "$BIN" | grep -q 'Machine: *AArch64' || fail "$BIN is not an AArch64 binary"
  local version
  version=$(QEMU_LD_PREFIX=$SYSROOT qemu-aarch64 "$BIN" --version)
  [[ $version == "persistent-pod-state $(awk -F'"' '/^version = / {print $2; exit}' Cargo.toml)" ]] ||
    fail "the arm64 binary printed '$version' as its version"
  QEMU_LD_PREFIX=$SYSROOT qemu-aarch64 "$BIN" crd | grep -q 'kind: CustomResourceDefinition' ||
    fail "the arm64 binary does not print the CRD"
  say "$BIN: AArch64, runs under qemu-aarch64 ($version)"
}

# The krew plugin of both builds: a platform per archive with its sha256, and the arm64
# archive's kubectl-pps answering as the plugin.
krew() {
  local x86=$1 out
  out=$(mktemp -d)
  local made
  made=$(bash plugins/krew/package.sh "$out" "$x86" "$BIN") || fail "package.sh failed"
  mapfile -t archives <<<"$made"
  ((${#archives[@]} == 2)) || fail "package.sh made ${#archives[@]} archives of 2 binaries"
  local arch sum
  for arch in amd64 arm64; do
    sum=$(sha256sum "$out"/kubectl-pps-*-linux-$arch.tar.gz | cut -d' ' -f1)
    grep -A4 "arch: $arch\$" "$out/pps.yaml" | grep -q "sha256: $sum\$" ||
      fail "the krew manifest does not give linux/$arch its archive's sha256 $sum"
  done
  mkdir "$out/arm64"
  tar -xzf "$out"/kubectl-pps-*-linux-arm64.tar.gz -C "$out/arm64"
  QEMU_LD_PREFIX=$SYSROOT qemu-aarch64 "$out/arm64/kubectl-pps" --help | grep -q 'kubectl pps' ||
    fail "the arm64 archive's kubectl-pps does not answer as the plugin"
  say "krew: $(grep -c 'arch:' "$out/pps.yaml") platforms (linux/amd64, linux/arm64), each with its archive's sha256"
  rm -rf "$out"
}

case "${1:-}" in
  build)
    build
    [[ -z ${2:-} ]] || krew "$2"
    echo "$BIN"
    ;;
  e2e)
    shift
    build
    # What the suite starts as persistent-pod-state (the replicas, the CRD and certificates,
    # the fake kubelet's containers of that image): the arm64 binary, emulated. `exec` keeps
    # the pid the suite records, and QEMU hands the program the signals it is sent.
    wrapper_dir="$(dirname "$BIN")/emulated"
    mkdir -p "$wrapper_dir"
    cat >"$wrapper_dir/persistent-pod-state" <<EOF
#!/bin/sh
QEMU_LD_PREFIX=$SYSROOT exec qemu-aarch64 "$BIN" "\$@"
EOF
    chmod +x "$wrapper_dir/persistent-pod-state"
    say "the e2e tests $* with the replicas on the arm64 binary, emulated"
    PPS_BIN="$wrapper_dir/persistent-pod-state" bash e2e/run.sh "$@"
    ;;
  *)
    fail "usage: bash e2e/arm64.sh build [X86_64_BINARY] | e2e TESTS..."
    ;;
esac
