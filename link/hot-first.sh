#!/usr/bin/env bash
# The linker of x86-64 Linux builds (.cargo/config.toml): `cc`, as rustc would call it, and then,
# for the shipped binary (persistent-pod-state, release), a second link that places the
# functions link/hot-functions.txt names first and together, in its order, hottest first.
#
# A review runs a few hundred functions spread over the binary's 15 MB of code, most of them
# fetched cold between two reviews; placed together they take about 140 pages of 4 KiB instead
# of about 680 (BENCHMARKS.md, part 3), all in the code's first 2 MiB, which `serve` then runs
# from one huge page (src/hot_code.rs). The list names functions by their demangled names
# without crate hashes (link/lib.sh), so it holds across features, dependency updates and
# compilers: what it names and the build lacks is skipped. link/check.sh checks the result (the
# image's build runs it: rustc shows a linker's warnings only from 1.97 on). If the second link
# cannot be made, the first one's binary stands, with a warning.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

cc "$@" || exit

# The output, from the arguments or from a response file (@FILE) rustc passes them in.
out=
prev=
for arg in "$@"; do
  if [[ $prev == -o ]]; then out=$arg; fi
  if [[ $arg == @* && -f ${arg#@} ]]; then
    file_out=$(sed -n '/^-o$/{n;s/\\\(.\)/\1/g;p;q}' "${arg#@}")
    [[ -n $file_out ]] && out=$file_out
  fi
  prev=$arg
done
[[ $out == */release/deps/persistent_pod_state-* ]] || exit 0

warn() { echo "link/hot-first.sh: $*; the binary keeps the default layout" >&2; exit 0; }
work=$(mktemp -d) || warn "no temporary directory"
trap 'rm -rf "$work"' EXIT
source "$here/lib.sh"

# The build's own names of the listed functions (every copy of each), in the list's order.
keyed_functions "$out" >"$work/functions" 2>/dev/null || warn "nm or c++filt failed"
grep -q $'\t_ZN20persistent_pod_state' "$work/functions" &&
  warn "the crate was mangled the legacy way (RUSTFLAGS set? it replaces .cargo/config.toml's flags)"
awk -F '\t' 'FILENAME == ARGV[1] { rank[$0] = FNR; next } ($4 in rank) { print rank[$4] "\t" $3 }' \
  <(listed_keys "$here/hot-functions.txt") "$work/functions" | sort -t $'\t' -k1,1n -s | cut -f 2 |
  awk '!seen[$0]++' >"$work/order"
[[ -s $work/order ]] || warn "none of link/hot-functions.txt's functions found"

cp "$out" "$work/plain" || warn "cannot keep the first link"
# The code's segment on a 2 MiB boundary, in the file and in memory (up to 4 MiB of padding in
# the file), so that its first 2 MiB, where the listed functions are, can run from one huge
# page (src/hot_code.rs).
if ! cc "$@" -Wl,--symbol-ordering-file="$work/order" -Wl,--no-warn-symbol-ordering \
  -Wl,-z,separate-code -Wl,-z,max-page-size=0x200000; then
  cp "$work/plain" "$out" || { echo "link/hot-first.sh: cannot restore $out" >&2; exit 1; }
  warn "the ordered link failed (rustc before 1.90 links with GNU ld, which has no --symbol-ordering-file)"
fi
