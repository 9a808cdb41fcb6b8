#!/usr/bin/env bash
# Router-added latency and Route throughput, side by side on one machine:
#   kvmesh node  vs  vllm-router and sglang-router (PyPI), in front of the same engine-sims.
#
# Usage: tests/load/router_compare.sh [seconds per run, default 10]
# Needs: cargo, python3 with venv and pip (PyPI reachable). Writes the table to stdout and the
# raw JSON lines to target/router-compare/*.jsonl.
#
# Added latency = latency through the router − latency straight to the engines (client-side
# round robin), at the same offered rate; each router runs alone (the others stopped) so they
# do not compete for the two cores. Engines are kvmesh-engine-sim at --speed 1000 (a step of a
# few microseconds; tokio's 1 ms timer dominates the engine time, equally for every target).
set -euo pipefail
cd "$(dirname "$0")/../.."
SECS=${1:-10}
OUT=target/router-compare
mkdir -p "$OUT"
rm -f "$OUT"/*.jsonl
cargo build --release -q -p kvmesh-cli -p kvmesh-engine-sim
B=target/release
VENV="$OUT/venv"
if [ ! -x "$VENV/bin/vllm-router" ] || [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q vllm-router sglang-router
fi
VLLM_ROUTER_VERSION=$("$VENV/bin/pip" show vllm-router | awk '/^Version/{print $2}')
SGLANG_ROUTER_VERSION=$("$VENV/bin/pip" show sglang-router | awk '/^Version/{print $2}')

PIDS=()
cleanup() { for p in "${PIDS[@]:-}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

ENGINES=()
for i in 0 1 2 3; do
  "$B/kvmesh-engine-sim" --http 127.0.0.1:1900$i --kv-events tcp://127.0.0.1:1950$i \
    --replay tcp://127.0.0.1:1960$i --speed 1000 >"$OUT/engine$i.log" 2>&1 &
  PIDS+=($!)
  ENGINES+=("http://127.0.0.1:1900$i")
done
DIRECT=$(IFS=,; echo "${ENGINES[*]}")
cat >"$OUT/node.toml" <<TOML
[node]
http = "127.0.0.1:19100"
grpc = "127.0.0.1:19101"
$(for i in 0 1 2 3; do printf '\n[[replicas]]\nname = "e%s"\nhttp = "http://127.0.0.1:1900%s"\nkv_events = "tcp://127.0.0.1:1950%s"\nreplay = "tcp://127.0.0.1:1960%s"\ncapacity_blocks = 29375\n' $i $i $i $i; done)
TOML

wait_up() { for _ in $(seq 100); do curl -sf -o /dev/null "$1" && return 0; sleep 0.1; done; echo "not up: $1" >&2; return 1; }
for e in "${ENGINES[@]}"; do wait_up "$e/health"; done

run_load() { # name url rate
  local rate=$3 conc=64
  "$B/kvmesh" loadtest --url "$2" --rate "$rate" --concurrency $conc --duration "$SECS" --warmup 2 --json \
    | sed "s/^{/{\"target\":\"$1\",/" >>"$OUT/http.jsonl"
}
measure() { # name url
  for rate in 200 500 0; do run_load "$1" "$2" $rate; done
}

measure direct "$DIRECT"

"$B/kvmesh" node --config "$OUT/node.toml" >"$OUT/node.log" 2>&1 & NODE=$!; PIDS+=($NODE)
wait_up http://127.0.0.1:19100/health
measure kvmesh http://127.0.0.1:19100
for c in 8 32; do
  "$B/kvmesh" loadtest --mode route --url http://127.0.0.1:19101 --concurrency $c --duration "$SECS" --warmup 2 --json \
    | sed "s/^{/{\"target\":\"kvmesh-route-$c\",/" >>"$OUT/route.jsonl"
done
kill $NODE; wait $NODE 2>/dev/null || true

# The same node with one runtime worker (`--workers 1`): on two cores shared with the
# engines and the load generator, fewer threads mean fewer cross-thread wake-ups.
"$B/kvmesh" node --config "$OUT/node.toml" --workers 1 >"$OUT/node-w1.log" 2>&1 & NODE=$!; PIDS+=($NODE)
wait_up http://127.0.0.1:19100/health
measure "kvmesh --workers 1" http://127.0.0.1:19100
kill $NODE; wait $NODE 2>/dev/null || true

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
import json, sys
out = sys.argv[1]
rows = [json.loads(l) for l in open(f"{out}/http.jsonl")]
direct = {r["offered_rps"]: r for r in rows if r["target"] == "direct"}
print("| target | offered | achieved req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | errors |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    d = direct[r["offered_rps"]]
    offered = "saturation (64 workers)" if r["offered_rps"] == 0 else f'{r["offered_rps"]:.0f} req/s'
    added = ("—", "—") if r["offered_rps"] == 0 or r["target"] == "direct" else (f'{r["p50_ms"] - d["p50_ms"]:.3f}', f'{r["p99_ms"] - d["p99_ms"]:.3f}')
    errors = sum(r["errors"].values()) + r["dropped"]
    print(f'| {r["target"]} | {offered} | {r["achieved_rps"]:.0f} | {r["p50_ms"]:.3f} | {r["p99_ms"]:.3f} | {added[0]} | {added[1]} | {errors} |')
print()
print("| kvmesh gRPC Route (+ Release) | Route calls/s | Route p50 ms | Route p99 ms |")
print("|---|---|---|---|")
for l in open(f"{out}/route.jsonl"):
    r = json.loads(l)
    print(f'| {r["target"]} | {r["achieved_rps"]:.0f} | {r["p50_ms"]:.3f} | {r["p99_ms"]:.3f} |')
PY
