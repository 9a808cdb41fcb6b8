#!/usr/bin/env bash
# Prefill/decode-disaggregated routing, side by side on one machine: kvmesh vs
# `vllm-router --vllm-pd-disaggregation` and `sglang-router launch --pd-disaggregation`
# (PyPI), in front of the same 2 prefill + 2 decode engine-sims, the same load, one script.
#
# Usage: tests/load/pd_compare.sh [seconds per run, default 20] [rate req/s, default 20]
#   environment: SPEED (engine time compression, default 1: H100 step times), PREFIXES (shared
#   system prompts, default 64), PREFIX_TOKENS (each, default 4096), MAX_TOKENS (default 64)
# Needs: cargo, python3 with venv and pip (PyPI reachable). Prints a Markdown table; the raw
# JSON lines go to target/pd-compare/*.jsonl.
#
# Engines: kvmesh-engine-sim --role prefill|decode at --speed $SPEED, the KV link 100 Gb/s. A prefill leg answers with NixlConnector's kv_transfer_params; a decode leg
# waits for its prompt's KV over the link, then generates. vllm-router runs vLLM's flow (NIXL
# connector, its default); sglang-router runs SGLang's (bootstrap room to both sides at once:
# the engine-sim takes bootstrap_room by its role); kvmesh runs vLLM's. Load: `kvmesh
# loadtest --stream`, open loop, $PREFIXES shared system prompts of $PREFIX_TOKENS tokens each
# with a unique question, $MAX_TOKENS tokens generated (64 × 4,096 tokens fit one engine's KV:
# where a router sends each prefix decides how much prefill is recomputed). Each router runs alone (the others stopped). Where each
# router's choices went is read from the engines' own counts (`GET /admin/pd`) before and
# after its run.
set -euo pipefail
cd "$(dirname "$0")/../.."
SECS=${1:-20}
RATE=${2:-20}
SPEED=${SPEED:-1}
PREFIXES=${PREFIXES:-64}
PREFIX_TOKENS=${PREFIX_TOKENS:-4096}
MAX_TOKENS=${MAX_TOKENS:-64}
OUT=target/pd-compare
mkdir -p "$OUT"
rm -f "$OUT"/*.jsonl
# KVMESH_BIN: a directory with kvmesh and kvmesh-engine-sim already built (CI's short run
# uses target/debug); default: a release build here.
if [ -n "${KVMESH_BIN:-}" ]; then
  B=$KVMESH_BIN
else
  cargo build --release -q -p kvmesh-cli -p kvmesh-engine-sim
  B=target/release
fi
VENV="$OUT/venv"
if [ ! -x "$VENV/bin/vllm-router" ] || [ ! -x "$VENV/bin/sglang-router" ]; then
  python3 -m venv "$VENV"
  # The versions measured in BENCHMARKS.md.
  "$VENV/bin/pip" install -q "vllm-router==0.1.17" "sglang-router==0.3.2"
fi
VLLM_ROUTER_VERSION=$("$VENV/bin/pip" show vllm-router | awk '/^Version/{print $2}')
SGLANG_ROUTER_VERSION=$("$VENV/bin/pip" show sglang-router | awk '/^Version/{print $2}')

PIDS=()
cleanup() { for p in "${PIDS[@]:-}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

ROLES=(prefill prefill decode decode)
for i in 0 1 2 3; do
  "$B/kvmesh-engine-sim" --http 127.0.0.1:1920$i --kv-events tcp://127.0.0.1:1925$i \
    --replay tcp://127.0.0.1:1928$i --speed "$SPEED" --role "${ROLES[$i]}" >"$OUT/engine$i.log" 2>&1 &
  PIDS+=($!)
done
E=(http://127.0.0.1:19200 http://127.0.0.1:19201 http://127.0.0.1:19202 http://127.0.0.1:19203)
cat >"$OUT/node.toml" <<TOML
[node]
http = "127.0.0.1:19210"
grpc = "127.0.0.1:19211"
$(for i in 0 1 2 3; do printf '\n[[replicas]]\nname = "%s%s"\nhttp = "http://127.0.0.1:1920%s"\nkv_events = "tcp://127.0.0.1:1925%s"\nreplay = "tcp://127.0.0.1:1928%s"\ncapacity_blocks = 29375\nrole = "%s"\n' "${ROLES[$i]:0:1}" $i $i $i $i "${ROLES[$i]}"; done)
TOML

wait_up() { for _ in $(seq 150); do curl -sf -o /dev/null "$1" && return 0; sleep 0.1; done; echo "not up: $1" >&2; return 1; }
for e in "${E[@]}"; do wait_up "$e/health"; done

counts() { # the four engines' /admin/pd counts as one JSON array
  printf '['; for i in 0 1 2 3; do [ $i -gt 0 ] && printf ','; curl -sf "${E[$i]}/admin/pd"; done; printf ']'
}
measure() { # name url
  local before after
  before=$(counts)
  "$B/kvmesh" loadtest --url "$2" --rate "$RATE" --concurrency 256 --duration "$SECS" --warmup 3 --stream \
    --prefixes "$PREFIXES" --prefix-tokens "$PREFIX_TOKENS" --max-tokens "$MAX_TOKENS" --json >"$OUT/run.json"
  after=$(counts)
  python3 - "$1" "$before" "$after" "$OUT/run.json" >>"$OUT/pd.jsonl" <<'PY'
import json, sys
name, before, after, run = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.load(open(sys.argv[4]))
d = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
run.update(target=name, prefill_legs=[x["prefill"] for x in d[:2]], decode_legs=[x["decode"] for x in d[2:]],
           whole=sum(x["whole"] for x in d))
print(json.dumps(run))
PY
}

"$B/kvmesh" node --config "$OUT/node.toml" >"$OUT/node.log" 2>&1 & NODE=$!; PIDS+=($NODE)
wait_up http://127.0.0.1:19210/health
measure "kvmesh (token_load)" http://127.0.0.1:19210
kill $NODE; wait $NODE 2>/dev/null || true

"$VENV/bin/vllm-router" --vllm-pd-disaggregation --host 127.0.0.1 --port 19220 \
  --prefill "${E[0]}" --prefill "${E[1]}" --decode "${E[2]}" --decode "${E[3]}" >"$OUT/vllm-router.log" 2>&1 &
VR=$!; PIDS+=($VR)
wait_up http://127.0.0.1:19220/health
measure "vllm-router $VLLM_ROUTER_VERSION (cache_aware)" http://127.0.0.1:19220
kill $VR; wait $VR 2>/dev/null || true

"$VENV/bin/python" -m sglang_router.launch_router --pd-disaggregation --host 127.0.0.1 --port 19230 \
  --prefill "${E[0]}" 8998 --prefill "${E[1]}" 8999 --decode "${E[2]}" --decode "${E[3]}" >"$OUT/sglang-router.log" 2>&1 &
SR=$!; PIDS+=($SR)
wait_up http://127.0.0.1:19230/health
measure "sglang-router $SGLANG_ROUTER_VERSION (cache_aware)" http://127.0.0.1:19230
kill $SR; wait $SR 2>/dev/null || true

python3 - "$OUT/pd.jsonl" "$RATE" "$SECS" "$SPEED" "$PREFIXES" "$PREFIX_TOKENS" "$MAX_TOKENS" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
rate, secs, speed, prefixes, ptok, out = sys.argv[2:8]
print(f"\nOffered {rate} req/s for {secs} s, streamed; {prefixes} prefixes of {ptok} tokens, {out} output tokens; "
      f"2 prefill + 2 decode engine-sims (speed {speed}).\n")
print("| router | TTFT p50 | TTFT p99 | ITL p99 | E2E p99 | req/s | errors | prefill legs p0/p1 | decode legs d0/d1 | whole |")
print("|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    err = sum(r.get("errors", {}).values()) if isinstance(r.get("errors"), dict) else r.get("errors", 0)
    print(f"| {r['target']} | {r.get('ttft_p50_ms', 0):.1f} ms | {r.get('ttft_p99_ms', 0):.1f} ms | {r.get('itl_p99_ms', 0):.1f} ms "
          f"| {r.get('p99_ms', 0):.1f} ms | {r.get('achieved_rps', 0):.1f} | {err} | {r['prefill_legs'][0]}/{r['prefill_legs'][1]} "
          f"| {r['decode_legs'][0]}/{r['decode_legs'][1]} | {r['whole']} |")
# Every router must have served requests, and kvmesh every one of them as a prefill and a
# decode leg, without an error.
kvmesh = rows[0]
ok = all(r.get("ok", 0) > 0 for r in rows) and not kvmesh.get("errors") and kvmesh["whole"] == 0 \
    and sum(kvmesh["decode_legs"]) >= kvmesh["ok"] and sum(kvmesh["prefill_legs"]) >= kvmesh["ok"]
sys.exit(0 if ok else 1)
PY
