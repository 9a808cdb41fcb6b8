#!/usr/bin/env bash
# The endpoint picker's cost per request beside Router.Route's, on one node, same run:
#   kvmesh loadtest --mode epp (a full-duplex ext_proc stream per request, as a gateway sends
#   it: headers, JSON body, the pick, then a streamed response followed to the release)
#   vs --mode route (Route + Release), closed loop at 8 and 32 workers, alternating, 3 reps.
# Both send distinct text prompts of the same shape (a shared system prompt + a question), so
# the node tokenizes and decides each request once either way.
#
# Usage: tests/load/epp_bench.sh [seconds per run, default 10]
# Writes target/epp-bench/runs.jsonl and prints one line per run.
set -euo pipefail
cd "$(dirname "$0")/../.."
SECS=${1:-10}
OUT=target/epp-bench
mkdir -p "$OUT"
rm -f "$OUT"/runs.jsonl
cargo build --release -q -p kvmesh-cli -p kvmesh-engine-sim
B=target/release
PIDS=()
cleanup() { for p in "${PIDS[@]:-}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM
for i in 0 1 2 3; do
  "$B/kvmesh-engine-sim" --http 127.0.0.1:1900$i --kv-events tcp://127.0.0.1:1950$i \
    --replay tcp://127.0.0.1:1960$i --speed 1000 >"$OUT/engine$i.log" 2>&1 &
  PIDS+=($!)
done
cat >"$OUT/node.toml" <<TOML
[node]
http = "127.0.0.1:19100"
grpc = "127.0.0.1:19101"
$(for i in 0 1 2 3; do printf '\n[[replicas]]\nname = "e%s"\nhttp = "http://127.0.0.1:1900%s"\nkv_events = "tcp://127.0.0.1:1950%s"\nreplay = "tcp://127.0.0.1:1960%s"\ncapacity_blocks = 29375\n' $i $i $i $i; done)
TOML
"$B/kvmesh" node --config "$OUT/node.toml" >"$OUT/node.log" 2>&1 & PIDS+=($!)
for _ in $(seq 100); do "$B/kvmesh" status --grpc http://127.0.0.1:19101 2>/dev/null | grep -q '^ *e3 *ready' && break; sleep 0.2; done
for rep in 1 2 3; do
  for c in 8 32; do
    for mode in route epp; do
      "$B/kvmesh" loadtest --mode $mode --url http://127.0.0.1:19101 --concurrency $c --duration "$SECS" --warmup 2 --json \
        | sed "s/^{/{\"rep\":$rep,\"workers\":$c,/" | tee -a "$OUT/runs.jsonl" \
        | python3 -c 'import json,sys; r=json.load(sys.stdin); print("rep %(rep)s %(mode)-5s x%(workers)-2s %(achieved_rps)8.0f/s  p50 %(p50_ms).3f ms  p99 %(p99_ms).3f ms  errors %(errors)s" % r)'
    done
  done
done
