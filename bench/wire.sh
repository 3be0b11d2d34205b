#!/usr/bin/env bash
# Issue 22.2 on the wire: how long each webhook of the API part takes to answer, as the loopback
# sees it, from the last packet of a review the API server sent to the packet of the answer.
# That is the webhook process's whole share of a call (waking, TLS, HTTP, the handler,
# writing), where the webhook's own histogram times the handler only.
#
#   bash bench/wire.sh            # BENCH_ONLY=api bash bench/run.sh under tcpdump, then the table
#   bash bench/wire.sh CAPTURE    # the table only, from a capture this script made
#
# Needs tcpdump (and the right to capture on `lo`), which `make test` does not install; it is a
# diagnosis, not part of `make bench`. Ports as bench/run.sh sets them: ours 29443, the bare
# webhook 29500, the bare webhook answering our patch 29501 and its twin 29502. The API server
# calls each over one kept-alive connection (HTTP/1.1 since the webhooks are registered at
# 0.0.0.0; HTTP/2 with WEBHOOK_HOST=127.0.0.1) and the creates are sequential, so each server
# has one review in flight at a time; an answer is told from HTTP/2's window updates and pings
# by its size (over 300 bytes).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
command -v tcpdump >/dev/null || { echo "bench/wire.sh needs tcpdump on PATH" >&2; exit 1; }

capture=${1:-}
if [[ -z $capture ]]; then
  capture=$(mktemp /tmp/bench-wire.XXXXXX.pcap)
  tcpdump -i lo -n -s 96 -B 65536 -w "$capture" \
    'tcp and (port 29443 or port 29500 or port 29501 or port 29502)' 2>/dev/null &
  dump=$!
  trap 'kill -INT "$dump" 2>/dev/null || true' EXIT
  BENCH_ONLY=api bash "$ROOT/bench/run.sh"
  kill -INT "$dump"
  wait "$dump" || true
  trap - EXIT
  echo
  echo "capture: $capture"
fi

echo
echo "Each webhook's answer on the wire (µs from the review's last packet to the answer's):"
echo
echo "| webhook | answers | mean | p50 | p90 | p99 | p99.9 |"
echo "|---|---|---|---|---|---|---|"
tcpdump -tt -n -r "$capture" 2>/dev/null | awk '
  BEGIN { name[29443] = "ours"; name[29500] = "bare"; name[29501] = "bare, our patch"
          name[29502] = "its twin" }
  / length [0-9]+$/ {
    n = $NF + 0
    if (n == 0) next
    split($3, from, "."); split($5, to, ".")
    src = from[5] + 0; dst = to[5] + 0
    if (dst in name) { last[dst, src] = $1; due[dst, src] = 1 }
    else if ((src in name) && n > 300 && due[src, dst]) {
      printf "%s\t%.1f\n", name[src], ($1 - last[src, dst]) * 1e6
      due[src, dst] = 0
    }
  }' | sort -t $'\t' -k1,1 -k2,2n | awk -F '\t' '
  function row() {
    if (count == 0) return
    printf "| %s | %d | %.1f | %.1f | %.1f | %.1f | %.1f |\n", server, count, sum / count,
      v[int(count * 0.5) + 1], v[int(count * 0.9) + 1], v[int(count * 0.99) + 1],
      v[int(count * 0.999) + 1]
  }
  $1 != server { row(); server = $1; count = 0; sum = 0 }
  { v[++count] = $2; sum += $2 }
  END { row() }'
