#!/usr/bin/env bash
# Tests link/hot-first.sh on a two-function program linked as the shipped binary would be: the
# listed functions come first, in the list's order; with a list naming nothing, or a second
# link that fails, the first link's binary stands and runs. Run by e2e/check-image.sh.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
fail() { echo "link/test.sh: $*" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/release/deps"
cp -r "$here" "$work/link"
cat >"$work/a.rs" <<'RS'
#[inline(never)]
fn alpha(x: u64) -> u64 { x.wrapping_mul(3) ^ 7 }
#[inline(never)]
fn omega(x: u64) -> u64 { x.rotate_left(5) + 1 }
fn main() { let n = std::env::args().count() as u64; println!("{}", alpha(n) + omega(n)); }
RS
# Links a.rs as target/release/deps/persistent_pod_state-NAME, through the copied wrapper.
link_as() {
  rustc -O -C symbol-mangling-version=v0 -C linker="$work/link/hot-first.sh" \
    -o "$work/release/deps/persistent_pod_state-$1" "$work/a.rs" 2>/dev/null
  [[ $("$work/release/deps/persistent_pod_state-$1") == 37 ]] || fail "$1: the binary does not run"
}
address() { nm "$work/release/deps/persistent_pod_state-$1" | awk -v f="$2" '$3 ~ "1a" length(f) f "$" { print $1 }'; }

printf '# two functions, omega first\na::omega\na::alpha\n' >"$work/link/hot-functions.txt"
link_as ordered
[[ $(address ordered omega) < $(address ordered alpha) && $(address ordered alpha) < $(address ordered main) ]] ||
  fail "the listed functions are not first, in the list's order"
bash "$work/link/check.sh" "$work/release/deps/persistent_pod_state-ordered" >/dev/null ||
  fail "link/check.sh refuses an ordered binary"

printf 'nothing::here\n' >"$work/link/hot-functions.txt"
link_as unlisted
! bash "$work/link/check.sh" "$work/release/deps/persistent_pod_state-unlisted" >/dev/null 2>&1 ||
  fail "link/check.sh accepts a binary where nothing listed is found"

# A second link that fails (cc given a flag it rejects only then): the first link's binary stays.
printf 'a::omega\n' >"$work/link/hot-functions.txt"
sed -i 's/-Wl,--no-warn-symbol-ordering/-Wl,--no-such-flag/' "$work/link/hot-first.sh"
link_as failed
echo "link/test.sh: ordered, unlisted and failed second links all give a working binary"
