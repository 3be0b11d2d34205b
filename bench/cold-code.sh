#!/usr/bin/env bash
# The code a review fetches cold (issue 22.1, BENCHMARKS.md part 2): callgrind's simulated
# last-level cache misses per review for the webhook's router and for the floor's handler, each
# given N reviews in process with a 4 MiB pass between them (`admission --route`), so that every
# review starts with the core's caches cold, as over HTTPS, where the kernel's and TLS's work
# runs between two reviews. Prints, per review, the instruction lines (64 bytes) fetched from
# beyond the simulated 1 MiB last-level cache and the instructions run: by step of the request
# (inclusive: what each step and everything it calls fetched), and by layer (each function's
# own lines, summed by the layer it belongs to).
#
# Unlike the timings of part 1, these counts do not move with the host's load: a change to the
# review's path can be judged by them in one run. Every simulated cache is given, not taken from
# the host: valgrind sizes the first-level caches as the CPU's, and where the instruction cache
# holds the floor's whole path (64 KiB on some Intel Xeons) the data pass leaves it there, so the
# counts would change with the host. Not part of `make test`: it needs valgrind
# (callgrind and callgrind_annotate on PATH) and takes about a minute.
#
#   bash bench/cold-code.sh [N]      (N reviews per route, default 2000)
set -euo pipefail
cd "$(dirname "$0")/.."

n=${1:-2000}
for tool in valgrind callgrind_annotate; do
    command -v "$tool" >/dev/null || { echo "bench/cold-code.sh: needs $tool (valgrind)" >&2; exit 2; }
done

bin=$(cargo bench --locked --features bench --bench admission --no-run --message-format=json |
    grep '"kind":\["bench"\]' | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1) || true
[ -x "$bin" ] || { echo "bench/cold-code.sh: the admission bench was not built" >&2; exit 1; }

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for route in router floor; do
    valgrind --tool=callgrind --cache-sim=yes --I1=32768,8,64 --D1=32768,8,64 --LL=1048576,16,64 \
        --callgrind-out-file="$out/$route.cg" "$bin" --route "$route" "$n" 2>"$out/$route.log" ||
        { cat "$out/$route.log" >&2; exit 1; }
    callgrind_annotate --inclusive=yes --show=ILmr,Ir --threshold=100 "$out/$route.cg" >"$out/$route.inclusive"
    callgrind_annotate --show=ILmr,Ir --threshold=100 "$out/$route.cg" >"$out/$route.self"
done

echo "Per review, in process, each after a 4 MiB pass ($n reviews through each; the setup spread"
echo "over them), $(git rev-parse --short HEAD): lines = 64-byte instruction lines missed in a"
echo "simulated 1 MiB last-level cache, instructions = instructions run."
echo
# Each line of callgrind_annotate's table: the two counts (each with its share in parentheses,
# but for a zero), then the function. Prints "count1 count2<TAB>function".
counts() {
    awk '{
        if (match($0, /^ *[0-9,]+( \( *[0-9.]+%\))? +[0-9,]+( \( *[0-9.]+%\))? +/)) {
            prefix = substr($0, 1, RLENGTH)
            gsub(/\( *[0-9.]+%\)|,/, "", prefix)
            split(prefix, c, " ")
            printf "%s %s\t%s\n", c[1], c[2], substr($0, RLENGTH + 1)
        }
    }' "$1"
}
{
    counts "$out/router.inclusive" | sed 's/^/router\tinclusive\t/'
    counts "$out/floor.inclusive" | sed 's/^/floor\tinclusive\t/'
    counts "$out/router.self" | sed 's/^/router\tself\t/'
    counts "$out/floor.self" | sed 's/^/floor\tself\t/'
} | awk -F '\t' -v n="$n" '
    # The step a function is, for each route (inclusive counts; the first match is taken).
    # Names come in both manglings: legacy (`Review::read`, `Oneshot<S,Req>`) and v0, which
    # the build uses since a3f10d9 (`<...Review>::read`, `Oneshot<axum::routing::Router, ...>`,
    # `from_slice::<...>`).
    function step(route, name) {
        if (name ~ /(^|:)<tower::util::oneshot::Oneshot</ && name ~ / as core::future::future::Future>::poll /) return "whole"
        if (route == "router" && name ~ /webhook::review::Review>?::read /) return "read"
        if (route == "floor" && name ~ /serde_json::de::from_slice( |::<)/) return "read"
        if (route == "router" && name ~ /webhook::admit::decide_view( |::<)/) return "decision"
        if (route == "router" && name ~ /webhook::review::Admission>?::into_response /) return "answer"
        if (route == "floor" && name ~ /benchkit::floor::fixed( |::<)/) return "answer"
        return ""
    }
    # The layer a function belongs to, by its name; the first rule that matches wins.
    function layer(name) {
        if (name ~ /webhook::review::(Admission|json_bytes)|serde_json::ser/) return "the decision, the patch and the answer"
        if (name ~ /serde|k8s_openapi|webhook::(review|compact)/) return "reading the review (serde, serde_json, k8s-openapi, webhook::review and ::compact)"
        if (name ~ /webhook::(admit|inject|patch|mutate_pod)|placement|persistent_pod_state::(state|workload|api)|kube|base64/) return "the decision, the patch and the answer"
        if (name ~ /btree|hash|Hash/) return "maps and hashing (either)"
        if (name ~ /axum|tower|hyper|http|matchit|tokio|bytes|futures/) return "routing, limits, the runtime (axum, tower, http, tokio)"
        if (name ~ /mi_|__rust_(alloc|dealloc|realloc)|alloc::/) return "allocation"
        if (name ~ /prometheus|tracing|metrics/) return "metrics and logging"
        return "the rest (core, libc, the bench loop)"
    }
    {
        route = $1; kind = $2; split($3, c, " "); name = $4
        if (name ~ /PROGRAM TOTALS/) { if (kind == "self") { total[route] = c[1]; instr[route] = c[2] }; next }
        if (kind == "inclusive") {
            s = step(route, name)
            if (s != "" && !((route, s) in lines)) { lines[route, s] = c[1]; runs[route, s] = c[2] }
            next
        }
        by[route, layer(name)] += c[1]
    }
    function row(label, s,    r, f) {
        r = lines["router", s]; f = lines["floor", s]
        printf "| %s | %.0f | %.0f | %+.0f | %.0f | %.0f |\n", label, r / n, f / n, (r - f) / n, runs["router", s] / n, runs["floor", s] / n
    }
    END {
        printf "| step (inclusive) | ours (lines) | floor (lines) | ours over the floor | ours (instructions) | floor (instructions) |\n|---|---|---|---|---|---|\n"
        row("reading the review (ours: `Review::read`; the floor: its uid)", "read")
        row("the decision and the patch (`decide_view`)", "decision")
        row("the answer (ours: `Admission::into_response`; the floor: `floor::fixed`)", "answer")
        for (i = 1; i <= 2; i++) {
            route = (i == 1) ? "router" : "floor"
            lines[route, "rest"] = lines[route, "whole"] - lines[route, "read"] - lines[route, "decision"] - lines[route, "answer"]
            runs[route, "rest"] = runs[route, "whole"] - runs[route, "read"] - runs[route, "decision"] - runs[route, "answer"]
        }
        row("the rest: routing, limits, metrics, the span", "rest")
        row("**the whole request through the router**", "whole")
        count = split("reading the review (serde, serde_json, k8s-openapi, webhook::review and ::compact)|the decision, the patch and the answer|maps and hashing (either)|routing, limits, the runtime (axum, tower, http, tokio)|allocation|metrics and logging|the rest (core, libc, the bench loop)", order, "|")
        printf "\n| layer (each function'"'"'s own lines) | ours (lines) | floor (lines) | ours over the floor |\n|---|---|---|---|\n"
        for (i = 1; i <= count; i++) {
            l = order[i]
            printf "| %s | %.0f | %.0f | %+.0f |\n", l, by["router", l] / n, by["floor", l] / n, (by["router", l] - by["floor", l]) / n
        }
        printf "| **all code** | **%.0f** | **%.0f** | **%+.0f** |\n", total["router"] / n, total["floor"] / n, (total["router"] - total["floor"]) / n
    }
'
