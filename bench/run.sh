#!/usr/bin/env bash
# The benchmark (issue 11), one command: `bash bench/run.sh` (full, tens of minutes; see
# BENCHMARKS.md) or `bash bench/run.sh --short` (CI: every figure produced, smaller and shorter;
# nothing is asserted about time). Prints one table per part:
#   1. admission over HTTPS against a bare axum+rustls baseline (bench-https)
#   2. the decision in process at 1, 1,000 (and 100,000) PersistentPodStates (cargo bench)
# With PERF_OUT=FILE (full mode), one more HTTPS run is profiled by `perf record` into FILE.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

mode=()
[[ ${1:-} == --short ]] && mode=(--short)

cargo build --release --locked --features bench --bins
perf_args=()
if [[ -n ${PERF_OUT:-} ]]; then
  perf_args=(--perf "$PERF_OUT")
fi
./target/release/bench-https "${mode[@]}" "${perf_args[@]}"

echo
echo "The admission decision in process (issue 11.2), µs per pod:"
echo
cargo bench --locked --features bench --bench admission -- "${mode[@]}"
