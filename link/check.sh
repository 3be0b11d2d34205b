#!/usr/bin/env bash
# Checks that a binary was linked by link/hot-first.sh with its hot code together: most of the
# functions link/hot-functions.txt names are found, all of them found lie in one stretch of code
# not much longer than their own sizes, and that stretch lies in the 2 MiB-aligned range where
# the code starts, which `serve` puts on a huge page (src/hot_code.rs). Prints how many were
# found and the 4 KiB pages they take; with --report, prints and exits 0 whatever the layout
# (for the default layout's figures).
#
#   bash link/check.sh [--report] BINARY
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/lib.sh"
report=0
[[ ${1:-} == --report ]] && { report=1; shift; }
bin=${1:?usage: link/check.sh [--report] BINARY}

# The code's segment: its address and alignment (hex).
read -r code align < <(readelf -lW "$bin" | awk '$1 == "LOAD" && $8 == "E" { print $3, $9; exit }')
[[ -n ${code:-} ]] || { echo "link/check.sh: no code segment in $bin" >&2; exit 1; }

awk -F '\t' -v report="$report" -v code="$code" -v align="$align" '
  function hex(s,   i, v) { v = 0; s = tolower(s); for (i = 1; i <= length(s); i++) v = v * 16 + index("0123456789abcdef", substr(s, i, 1)) - 1; return v }
  FILENAME == ARGV[1] { want[$0] = 1; listed++; next }
  ($4 in want) {
    copies++
    if (!($4 in found)) { found[$4] = 1; n++ }
    start = hex($1); size = hex($2)
    if (!(start in at)) { at[start] = 1; bytes += size }
    if (lo == "" || start < lo) lo = start
    if (start + size > hi) hi = start + size
    for (p = int(start / 4096); p <= int((start + size - 1) / 4096); p++) if (!(p in page)) { page[p] = 1; pages++ }
  }
  END {
    span = hi - lo
    huge = 2097152
    window = hex(substr(code, 3)); window -= window % huge
    inside = hex(substr(align, 3)) >= huge && lo >= window && hi <= window + huge
    printf "hot functions: %d of %d listed found, %d copies, %.0f KiB, in %d pages of 4 KiB over %.2f MiB, %s\n", n, listed, 0 + copies, bytes / 1024, pages, span / 1048576, inside ? "within the huge page serve runs them from" : "not within a 2 MiB-aligned huge page (segments aligned to " align ")"
    if (report) exit 0
    if (listed == 0) { print "link/check.sh: link/hot-functions.txt lists nothing" > "/dev/stderr"; exit 1 }
    if (n < 0.8 * listed) { print "link/check.sh: fewer than 80 % of link/hot-functions.txt found; record it again (link/record-hot-functions.sh), unless RUSTFLAGS replaced the v0 names .cargo/config.toml asks for" > "/dev/stderr"; exit 1 }
    if (span > 1.25 * bytes + 4096) { print "link/check.sh: the hot functions are not together: was the binary linked by link/hot-first.sh (rustc 1.90 or later, linking with lld)?" > "/dev/stderr"; exit 1 }
    if (!inside) { print "link/check.sh: the hot functions are not in the 2 MiB where the code starts, so serve cannot run them from a huge page: was the binary linked by link/hot-first.sh?" > "/dev/stderr"; exit 1 }
  }' <(listed_keys "$here/hot-functions.txt") <(keyed_functions "$bin")
