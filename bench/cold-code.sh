#!/usr/bin/env bash
# The code a review fetches cold (issue 22.1, BENCHMARKS.md part 2): cachegrind's simulated
# last-level cache misses per review for the webhook's router and for the floor's handler, each
# given N reviews in process with a 4 MiB pass between them (`admission --route`), so that every
# review starts with the core's caches cold, as over HTTPS, where the kernel's and TLS's work
# runs between two reviews. Prints, per review, the instruction lines each layer fetched from
# beyond the simulated 1 MiB last-level cache, ours against the floor's, and the totals.
#
# Unlike the timings of part 1, these counts do not move with the host's load: a change to the
# review's path can be judged by them in one run. Not part of `make test`: it needs valgrind
# (cachegrind and cg_annotate on PATH) and takes about three minutes.
#
#   bash bench/cold-code.sh [N]      (N reviews per route, default 2000)
set -euo pipefail
cd "$(dirname "$0")/.."

n=${1:-2000}
for tool in valgrind cg_annotate; do
    command -v "$tool" >/dev/null || { echo "bench/cold-code.sh: needs $tool (valgrind)" >&2; exit 2; }
done

bin=$(cargo bench --locked --features bench --bench admission --no-run --message-format=json |
    grep '"kind":\["bench"\]' | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1) || true
[ -x "$bin" ] || { echo "bench/cold-code.sh: the admission bench was not built" >&2; exit 1; }

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for route in router floor; do
    valgrind --tool=cachegrind --cache-sim=yes --LL=1048576,16,64 \
        --cachegrind-out-file="$out/$route.cg" "$bin" --route "$route" "$n" 2>"$out/$route.log" ||
        { cat "$out/$route.log" >&2; exit 1; }
    cg_annotate --sort=ILmr --show=ILmr,DLmr,Ir --threshold=0 "$out/$route.cg" >"$out/$route.txt"
done

echo "Lines fetched cold per review (64-byte lines missed in a simulated 1 MiB last-level cache;"
echo "$n reviews through each, the setup spread over them), $(git rev-parse --short HEAD):"
echo
awk -v n="$n" '
    # The layer a function belongs to, by its name; the first rule that matches wins.
    function layer(name) {
        if (name ~ /webhook::review::(Admission|json_bytes)|serde_json::ser/) return "the decision, the patch and the answer"
        if (name ~ /serde|k8s_openapi|webhook::review/) return "reading the review (serde, serde_json, k8s-openapi, webhook::review)"
        if (name ~ /webhook::(admit|inject|patch|mutate_pod)|placement|persistent_pod_state::(state|workload|api)|kube|base64/) return "the decision, the patch and the answer"
        if (name ~ /btree|hash|Hash/) return "maps and hashing (either)"
        if (name ~ /axum|tower|hyper|http|matchit|tokio|bytes|futures/) return "routing, limits, the runtime (axum, tower, http, tokio)"
        if (name ~ /mi_|__rust_(alloc|dealloc|realloc)|alloc::/) return "allocation"
        if (name ~ /prometheus|tracing|metrics/) return "metrics and logging"
        return "the rest (core, libc, the bench loop)"
    }
    BEGIN {
        count = split("reading the review (serde, serde_json, k8s-openapi, webhook::review)|the decision, the patch and the answer|maps and hashing (either)|routing, limits, the runtime (axum, tower, http, tokio)|allocation|metrics and logging|the rest (core, libc, the bench loop)", order, "|")
    }
    FNR == 1 { route = (FILENAME ~ /router/) ? "router" : "floor" }
    /PROGRAM TOTALS/ || /\?\?\?:|\.[cS]:/ {
        line = $0
        gsub(/\( *[0-9.]+%\)/, "", line)
        gsub(/,/, "", line)
        split(line, f, " ")
        name = line
        sub(/^ *[0-9]+ +[0-9]+ +[0-9]+ +/, "", name)
        if (line ~ /PROGRAM TOTALS/) {
            ilmr[route, "total"] = f[1]; dlmr[route] = f[2]; ir[route] = f[3]
            next
        }
        l = layer(name)
        layers[l] = 1
        by[route, l] += f[1]
    }
    END {
        printf "| layer | ours (lines) | floor (lines) | ours over the floor |\n|---|---|---|---|\n"
        for (i = 1; i <= count; i++) {
            l = order[i]
            if (!(l in layers)) continue
            printf "| %s | %.0f | %.0f | %+.0f |\n", l, by["router", l] / n, by["floor", l] / n, (by["router", l] - by["floor", l]) / n
        }
        printf "| **all code** | **%.0f** | **%.0f** | **%+.0f** |\n", ilmr["router", "total"] / n, ilmr["floor", "total"] / n, (ilmr["router", "total"] - ilmr["floor", "total"]) / n
        printf "\nData lines missed per review, ours over the floor: %+.0f (each route also misses the\n", (dlmr["router"] - dlmr["floor"]) / n
        printf "4 MiB pass, %.0f lines). Instructions per review, ours over the floor: %+.0f.\n", dlmr["floor"] / n, (ir["router"] - ir["floor"]) / n
    }
' "$out/router.txt" "$out/floor.txt"
