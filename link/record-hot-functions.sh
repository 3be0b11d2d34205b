#!/usr/bin/env bash
# Writes link/hot-functions.txt, the order link/hot-first.sh links the shipped binary in: the
# functions of persistent-pod-state that `serve`'s admission threads were sampled in, hottest
# first, by their keys (link/lib.sh). Record it from a replica answering the API server's calls,
# as in part 3 of the benchmark, and commit the list with the change that moved the review's
# path:
#
#   BENCH_ONLY=api bash bench/run.sh &          # wait for "pod CREATE latency", then
#   bash link/record-hot-functions.sh "$(cat /tmp/pps-bench.*/persistent-pod-state-a.pid)" 150
#
# A replica that runs its hot code from a huge page (src/hot_code.rs, the default) must write
# perf's map of it: start it with PPS_HOT_CODE_PERF_MAP=true (or with the page off,
# PPS_HOT_CODE_HUGE_PAGE=false). perf names that code from the map, by the same keys.
#
# Needs perf (linux-perf) and the right to sample the process.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/lib.sh"
pid=${1:?usage: link/record-hot-functions.sh PID [SECONDS]}
seconds=${2:-150}
data=$(mktemp /tmp/hot-functions.XXXXXX)
list=$(mktemp /tmp/hot-functions.XXXXXX)
trap 'rm -f "$data" "$list"' EXIT

dsos=$(basename "$(readlink -f "/proc/$pid/exe")")
# The huge page is an anonymous executable mapping (no file): perf names its functions from the
# map serve wrote (/tmp/perf-PID.map, demangled names without the crates' hashes: their keys),
# under the name "[JIT] tid PID".
if awk '$2 ~ /^r-x/ && NF == 5 { found = 1 } END { exit !found }' "/proc/$pid/maps"; then
  if [[ ! -s /tmp/perf-$pid.map ]]; then
    echo "link/record-hot-functions.sh: $pid runs its hot code from a huge page and wrote no perf map (/tmp/perf-$pid.map); start it with PPS_HOT_CODE_PERF_MAP=true" >&2
    exit 1
  fi
  dsos+=",[JIT] tid $pid"
fi
perf record -q -F 20000 -e cpu-clock -p "$pid" -o "$data" -- sleep "$seconds"
{
  echo "# Written by link/record-hot-functions.sh: the functions serve's admission threads ran,"
  echo "# hottest first (perf, $seconds s of part 3's rounds, $(date -u +%F))."
  # Each line: the share, "[.]", the name (the map's hold spaces).
  perf report -i "$data" --comms pps-admission --dsos "$dsos" \
    --no-children --sort sym --no-demangle --stdio -q -g none | sed -nE 's/^ *[0-9.]+% +\[\.\] (.*[^ ]) *$/\1/p' |
    symbol_keys | awk '!seen[$0]++'
} >"$list"
functions=$(listed_keys "$list" | wc -l)
((functions >= 50)) || { echo "link/record-hot-functions.sh: only $functions functions sampled; the list is kept" >&2; exit 1; }
cp "$list" "$here/hot-functions.txt"
echo "link/hot-functions.txt: $functions functions"
