#!/usr/bin/env bash
# Router-added latency and Route throughput, side by side on one machine:
#   kvmesh node  vs  vllm-router and sglang-router (PyPI)  vs  a bare pass-through (the floor),
#   in front of the same engine-sims.
#
# Usage: tests/load/router_compare.sh [seconds per run, default 10]
# Needs: cargo, python3 with venv and pip (PyPI reachable). Writes the table to stdout and the
# raw JSON lines to target/router-compare/*.jsonl.
#
# Added latency = latency through the router − latency straight to the engines (client-side
# round robin), at the same offered rate, both measured in the same run: `kvmesh loadtest
# --baseline` interleaves the direct requests with the router's, so drift between runs (the
# machine, the engines' timers) cancels out of the difference. Each router runs alone (the
# others stopped) so they do not compete for the two cores. `passthrough` (an example in
# crates/kvmesh-node) is the floor: the same HTTP libraries as kvmesh's proxy, doing nothing
# but forwarding. Engines are kvmesh-engine-sim at --speed 1000 (a step of a
# few microseconds; tokio's 1 ms timer dominates the engine time, equally for every target).
set -euo pipefail
cd "$(dirname "$0")/../.."
SECS=${1:-10}
OUT=target/router-compare
mkdir -p "$OUT"
rm -f "$OUT"/*.jsonl
cargo build --release -q -p kvmesh-cli -p kvmesh-engine-sim
cargo build --release -q -p kvmesh-node --example passthrough
B=target/release
VENV="$OUT/venv"
if [ ! -x "$VENV/bin/vllm-router" ] || [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q vllm-router sglang-router
fi
VLLM_ROUTER_VERSION=$("$VENV/bin/pip" show vllm-router | awk '/^Version/{print $2}')
SGLANG_ROUTER_VERSION=$("$VENV/bin/pip" show sglang-router | awk '/^Version/{print $2}')

. tests/load/four_engines.sh
start_four_engines 1900 1950 1960
four_engines_node_toml 127.0.0.1:19100 127.0.0.1:19101

run_load() { # name url rate rep [loadtest args…]
  local name=$1 url=$2 rate=$3 rep=$4; shift 4
  "$B/kvmesh" loadtest --url "$url" --rate "$rate" --concurrency 64 --duration "$SECS" --warmup 2 --json "$@" \
    | sed "s/^{/{\"target\":\"$name\",\"rep\":$rep,/" >>"$OUT/http.jsonl"
}
# Each router's block: three runs at 200 and at 500 req/s, each with the direct baseline
# interleaved at the same rate, then saturation once.
measure() { # name url
  for rep in 1 2 3; do
    for rate in 200 500; do
      run_load "$1" "$2" $rate $rep --baseline "$DIRECT"
    done
  done
  run_load "$1" "$2" 0 1
}

run_load direct "$DIRECT" 0 1

"$B/kvmesh" node --config "$OUT/node.toml" >"$OUT/node.log" 2>&1 & NODE=$!; PIDS+=($NODE)
wait_up http://127.0.0.1:19100/health
measure kvmesh http://127.0.0.1:19100
for c in 8 32; do
  "$B/kvmesh" loadtest --mode route --url http://127.0.0.1:19101 --concurrency $c --duration "$SECS" --warmup 2 --json \
    | sed "s/^{/{\"target\":\"kvmesh-route-$c\",/" >>"$OUT/route.jsonl"
done
kill $NODE; wait $NODE 2>/dev/null || true

"$B/examples/passthrough" 127.0.0.1:19400 "$DIRECT" >"$OUT/passthrough.log" 2>&1 & PT=$!; PIDS+=($PT)
wait_up http://127.0.0.1:19400/health
measure "passthrough (floor)" http://127.0.0.1:19400
kill $PT; wait $PT 2>/dev/null || true

"$VENV/bin/vllm-router" --host 127.0.0.1 --port 19200 --worker-urls "${ENGINES[@]}" --policy cache_aware \
  --prometheus-port 19201 >"$OUT/vllm-router.log" 2>&1 & VR=$!; PIDS+=($VR)
wait_up http://127.0.0.1:19200/health
measure "vllm-router-$VLLM_ROUTER_VERSION" http://127.0.0.1:19200
kill $VR; wait $VR 2>/dev/null || true

"$VENV/bin/python" -m sglang_router.launch_router --host 127.0.0.1 --port 19300 --worker-urls "${ENGINES[@]}" \
  --policy cache_aware --prometheus-port 19301 >"$OUT/sglang-router.log" 2>&1 & SR=$!; PIDS+=($SR)
wait_up http://127.0.0.1:19300/health
measure "sglang-router-$SGLANG_ROUTER_VERSION" http://127.0.0.1:19300
kill $SR; wait $SR 2>/dev/null || true

python3 - "$OUT" <<'PY'
import json, statistics, sys
out = sys.argv[1]
rows = [json.loads(l) for l in open(f"{out}/http.jsonl")]
def med(xs): return statistics.median(xs)
targets = [r["target"] for r in rows if not r["target"].startswith("direct")]
targets = list(dict.fromkeys(targets))
print("| target | offered | achieved req/s | p50 ms | p99 ms | direct p50 / p99 ms (interleaved) | added p50 ms (median of 3, range) | added p99 ms (median of 3, range) | errors |")
print("|---|---|---|---|---|---|---|---|---|")
sat_direct = [r for r in rows if r["target"] == "direct" and r["offered_rps"] == 0][0]
print(f'| direct | saturation (64 workers) | {sat_direct["achieved_rps"]:.0f} | {sat_direct["p50_ms"]:.3f} | {sat_direct["p99_ms"]:.3f} | — | — | — | {sum(sat_direct["errors"].values()) + sat_direct["dropped"]} |')
for t in targets:
    for rate in (200, 500):
        mine = [r for r in rows if r["target"] == t and r["offered_rps"] == rate]
        a50 = [m["added_p50_ms"] for m in mine]
        a99 = [m["added_p99_ms"] for m in mine]
        errors = sum(sum(m["errors"].values()) + m["dropped"] + sum(m["baseline"]["errors"].values()) + m["baseline"]["dropped"] for m in mine)
        print(f'| {t} | {rate} req/s | {med([m["achieved_rps"] for m in mine]):.0f} | {med([m["p50_ms"] for m in mine]):.3f} | {med([m["p99_ms"] for m in mine]):.3f} | '
              f'{med([m["baseline"]["p50_ms"] for m in mine]):.3f} / {med([m["baseline"]["p99_ms"] for m in mine]):.3f} | '
              f'{med(a50):.3f} ({min(a50):.3f} to {max(a50):.3f}) | {med(a99):.3f} ({min(a99):.3f} to {max(a99):.3f}) | {errors} |')
    sat = [r for r in rows if r["target"] == t and r["offered_rps"] == 0][0]
    print(f'| {t} | saturation (64 workers) | {sat["achieved_rps"]:.0f} | {sat["p50_ms"]:.3f} | {sat["p99_ms"]:.3f} | — | — | — | {sum(sat["errors"].values()) + sat["dropped"]} |')
print()
print("| kvmesh gRPC Route (+ Release) | Route calls/s | Route p50 ms | Route p99 ms |")
print("|---|---|---|---|")
for l in open(f"{out}/route.jsonl"):
    r = json.loads(l)
    print(f'| {r["target"]} | {r["achieved_rps"]:.0f} | {r["p50_ms"]:.3f} | {r["p99_ms"]:.3f} |')
PY
