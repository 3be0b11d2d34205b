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
# Start that replica with PPS_HOT_CODE_HUGE_PAGE=false: perf names no function of the code
# `serve` runs from a huge page (src/hot_code.rs), so this refuses such a process.
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

# The huge page is an anonymous executable mapping (no file, so no name perf could read).
if awk '$2 ~ /^r-x/ && NF == 5 { found = 1 } END { exit !found }' "/proc/$pid/maps"; then
  echo "link/record-hot-functions.sh: $pid runs its hot code from a huge page, where perf names nothing; start it with PPS_HOT_CODE_HUGE_PAGE=false" >&2
  exit 1
fi
perf record -q -F 20000 -e cpu-clock -p "$pid" -o "$data" -- sleep "$seconds"
{
  echo "# Written by link/record-hot-functions.sh: the functions serve's admission threads ran,"
  echo "# hottest first (perf, $seconds s of part 3's rounds, $(date -u +%F))."
  perf report -i "$data" --comms pps-admission --dsos "$(basename "$(readlink -f "/proc/$pid/exe")")" \
    --no-children --sort sym --no-demangle --stdio -q -g none | awk '{ print $NF }' |
    symbol_keys | awk '!seen[$0]++'
} >"$list"
functions=$(listed_keys "$list" | wc -l)
((functions >= 50)) || { echo "link/record-hot-functions.sh: only $functions functions sampled; the list is kept" >&2; exit 1; }
cp "$list" "$here/hot-functions.txt"
echo "link/hot-functions.txt: $functions functions"
