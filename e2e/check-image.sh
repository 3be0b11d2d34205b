#!/usr/bin/env bash
# No container engine runs here: build the release binary exactly as the Dockerfile does, check
# that it runs, and check the Dockerfile's structure (multi-stage, locked release build, a
# minimal non-root final image, sources it copies exist, .dockerignore keeps target/ out).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
fail() { echo "check-image: $*" >&2; exit 1; }

# In a target directory of its own: as in the image, a build of its own (and `make test` runs this
# beside the e2e suite, whose release binary under target/release has other features).
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}/image"
bin="$CARGO_TARGET_DIR/release/persistent-pod-state"

build_cmd=$(sed -n 's/^RUN \(cargo build .*\)$/\1/p' Dockerfile)
[[ $build_cmd == "cargo build --release --locked --bin persistent-pod-state" ]] || fail "unexpected build command: $build_cmd"
$build_cmd
"$bin" --version
# Linked by link/hot-first.sh: the review's hot functions together (the Dockerfile copies its
# settings and the list, checked below with every COPY source).
bash link/check.sh "$bin"
bash link/test.sh
grep -qx 'COPY .cargo ./.cargo' Dockerfile && grep -qx 'COPY link ./link' Dockerfile &&
  grep -qx 'RUN if \[ "$(uname -m)" = x86_64 \]; then bash link/check.sh target/release/persistent-pod-state; fi' Dockerfile ||
  fail "the Dockerfile does not copy the build's settings (.cargo) and its linker (link), or check the layout"
"$bin" crd | grep -q 'kind: CustomResourceDefinition' || fail "binary does not print the CRD"

# The SBOM: made as the Dockerfile makes it (the pinned cargo-cyclonedx, installed when missing),
# naming the exact versions Cargo.lock resolves for the binary's crates and no dev dependency,
# and copied into the final image.
cdx_version=$(sed -n 's/.*cargo install --locked cargo-cyclonedx --version \([0-9.]*\).*/\1/p' Dockerfile)
[[ -n $cdx_version ]] || fail "the Dockerfile does not install a pinned cargo-cyclonedx"
cargo cyclonedx --version 2>/dev/null | grep -q " $cdx_version$" ||
  cargo install --locked cargo-cyclonedx --version "$cdx_version"
sbom_cmd=$(sed -n 's/^ *\(cargo cyclonedx .*\)$/\1/p' Dockerfile)
[[ -n $sbom_cmd ]] || fail "the Dockerfile makes no SBOM"
$sbom_cmd
sbom=persistent-pod-state_bin.cdx.json
[[ -s $sbom ]] || fail "no $sbom made"
locked() { awk -v n="$1" '$0 == "name = \"" n "\"" {getline; gsub(/version = |"/, ""); print; exit}' Cargo.lock; }
for crate in kube rustls ring axum tokio json-patch k8s-openapi; do
  grep -q "\"pkg:cargo/$crate@$(locked "$crate")" "$sbom" || fail "the SBOM does not name $crate $(locked "$crate")"
done
for dev in proptest tower-test cel promql-parser; do
  ! grep -q "\"pkg:cargo/$dev@" "$sbom" || fail "the SBOM names the dev dependency $dev"
done
grep -q "^COPY --from=build /src/$sbom " Dockerfile || fail "the final image does not carry the SBOM"
echo "check-image: SBOM $sbom: $(grep -c '"purl"' "$sbom") components"
rm -f ./*.cdx.json

stages=$(grep -c '^FROM ' Dockerfile)
(( stages >= 2 )) || fail "not multi-stage ($stages FROM lines)"
final_from=$(grep '^FROM ' Dockerfile | tail -n1)
[[ $final_from == *distroless* && $final_from == *nonroot* ]] || fail "final image is not a minimal non-root one: $final_from"
user=$(awk '/^FROM /{u=""} /^USER /{u=$2} END{print u}' Dockerfile)
[[ -n $user && $user != root && $user != 0 && ${user%%:*} != 0 ]] || fail "final stage does not run as non-root (USER '$user')"
grep -q '^COPY --from=build /src/target/release/persistent-pod-state ' Dockerfile || fail "final stage does not copy the release binary"
while read -r src; do
  [[ -e $src ]] || fail "COPY source $src does not exist"
done < <(awk '/^COPY / && !/--from/ {for (i = 2; i < NF; i++) print $i}' Dockerfile)
grep -qx 'target/' .dockerignore || fail ".dockerignore does not exclude target/"
echo "check-image: Dockerfile structure ok; release binary built with: $build_cmd"
