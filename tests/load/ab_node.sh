#!/usr/bin/env bash
# Two builds of `kvmesh node` before the same four engine-sims, alternated in one run: the
# router-added HTTP latency (interleaved with a direct baseline, as tests/load/router_compare.sh
# measures it) at 200 and 500 req/s, and gRPC Route throughput (each Route followed by a
# Release) at 8 and 32 closed-loop workers. For a refactor's "no regression" check: the machine
# drifts between runs, so the two builds take turns, ROUNDS times, and each figure is the
# median of its rounds.
#
# Usage: tests/load/ab_node.sh KVMESH_A KVMESH_B [seconds per run, default 5] [rounds, default 3]
#   KVMESH_A / KVMESH_B: two `kvmesh` binaries (release builds); the engine-sims and the load
#   generator come from target/release (built here if missing).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_A=${1:?usage: ab_node.sh KVMESH_A KVMESH_B [seconds] [rounds]}
BUILD_B=${2:?usage: ab_node.sh KVMESH_A KVMESH_B [seconds] [rounds]}
SECS=${3:-5}
ROUNDS=${4:-3}
OUT=target/ab-node
mkdir -p "$OUT"
rm -f "$OUT"/*.jsonl
[ -x target/release/kvmesh-engine-sim ] && [ -x target/release/kvmesh ] ||
  cargo build --release -q -p kvmesh-cli -p kvmesh-engine-sim
R=target/release
B=$R

. tests/load/four_engines.sh
start_four_engines 1940 1945 1948
four_engines_node_toml 127.0.0.1:19410 127.0.0.1:19411

for round in $(seq "$ROUNDS"); do
  for side in A B; do
    bin=$BUILD_A; [ "$side" = B ] && bin=$BUILD_B
    "$bin" node --config "$OUT/node.toml" >"$OUT/node-$side.log" 2>&1 &
    NODE=$!
    wait_up http://127.0.0.1:19410/health
    sleep 1
    for rate in 200 500; do
      "$R/kvmesh" loadtest --url http://127.0.0.1:19410 --rate "$rate" --concurrency 64 --duration "$SECS" \
        --warmup 2 --baseline "$DIRECT" --json | sed "s/^{/{\"side\":\"$side\",\"round\":$round,\"rate\":$rate,/" \
        >>"$OUT/http.jsonl"
    done
    for c in 8 32; do
      "$R/kvmesh" loadtest --mode route --url http://127.0.0.1:19411 --concurrency "$c" --duration "$SECS" \
        --warmup 2 --json | sed "s/^{/{\"side\":\"$side\",\"round\":$round,\"workers\":$c,/" >>"$OUT/route.jsonl"
    done
    kill "$NODE"; wait "$NODE" 2>/dev/null || true
  done
done

python3 - "$OUT" "$BUILD_A" "$BUILD_B" <<'PY'
import json, statistics, sys
out, a, b = sys.argv[1:4]
def rows(f): return [json.loads(l) for l in open(f"{out}/{f}") if l.startswith("{")]
http, route = rows("http.jsonl"), rows("route.jsonl")
def med(xs): return statistics.median(xs) if xs else float("nan")
print(f"A = {a}\nB = {b}\n")
errors = sum(sum(r["errors"].values()) + r["dropped"] for r in http + route)
print(f"errors and drops, all runs: {errors}\n")
print("| measure | A (median, range) | B (median, range) | B / A |")
print("|---|---|---|---|")
def line(name, xs, ys, fmt):
    ma, mb = med(xs), med(ys)
    rng = lambda v: f"{fmt.format(min(v))}–{fmt.format(max(v))}" if v else "—"
    print(f"| {name} | {fmt.format(ma)} ({rng(xs)}) | {fmt.format(mb)} ({rng(ys)}) | {mb / ma:.2f}× |")
for rate in (200, 500):
    for q in ("p50", "p99"):
        get = lambda s: [r[f"added_{q}_ms"] for r in http if r["side"] == s and r["rate"] == rate]
        line(f"HTTP added {q} ms at {rate} req/s", get("A"), get("B"), "{:.3f}")
for c in (8, 32):
    get = lambda s: [r["achieved_rps"] for r in route if r["side"] == s and r["workers"] == c]
    line(f"Route calls/s, {c} workers", get("A"), get("B"), "{:.0f}")
PY
