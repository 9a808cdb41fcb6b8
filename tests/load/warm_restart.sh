#!/usr/bin/env bash
# Usage: KVMESH_BIN=target/release tests/load/warm_restart.sh   (ports 18051-18303 on loopback)
# Warm restart: 4 engine-sims warmed through a node, the node killed (-9) and started again;
# how long until the new node's index holds what the engines hold, with no request sent.
set -u
BIN="$(cd "${KVMESH_BIN:-target/release}" && pwd)"
WORK="$(mktemp -d)"; cd "$WORK"
for i in 0 1 2 3; do
  $BIN/kvmesh-engine-sim --http 127.0.0.1:$((18100+i)) --kv-events tcp://127.0.0.1:$((18200+i)) --replay tcp://127.0.0.1:$((18300+i)) --speed 50 > e$i.log 2>&1 &
done
cat > node.toml <<T
[node]
http = "127.0.0.1:18080"
grpc = "127.0.0.1:18051"
scrape_interval = "200ms"
T
for i in 0 1 2 3; do cat >> node.toml <<T
[[replicas]]
name = "e$i"
http = "http://127.0.0.1:$((18100+i))"
kv_events = "tcp://127.0.0.1:$((18200+i))"
replay = "tcp://127.0.0.1:$((18300+i))"
capacity_blocks = 29375
T
done
sleep 1
$BIN/kvmesh node --config node.toml > n1.log 2>&1 & N=$!
sleep 2
python3 - <<'P'
import json, urllib.request
for i in range(200):
    body = json.dumps({"model": "m", "prompt": f"{i:04d}:" * 400 + "question", "max_tokens": 4}).encode()
    urllib.request.urlopen(urllib.request.Request("http://127.0.0.1:18080/v1/completions", data=body, headers={"content-type": "application/json"}), timeout=30).read()
P
sleep 1
blocks() { $BIN/kvmesh status --grpc http://127.0.0.1:18051 --json 2>/dev/null | python3 -c "import sys, json; d=json.load(sys.stdin); print(sum(int(r['index_blocks']) for r in d['replicas']))" 2>/dev/null; }
before=$(blocks); echo "indexed before the kill: $before blocks"
kill -9 $N; wait $N 2>/dev/null
t0=$(date +%s.%N)
$BIN/kvmesh node --config node.toml > n2.log 2>&1 & N=$!
while :; do
  b=$(blocks); now=$(date +%s.%N)
  if [ -n "$b" ] && [ "$b" = "$before" ]; then echo "restarted node: $b blocks after $(python3 -c "print(round($now-$t0,3))") s from its start"; break; fi
  if python3 -c "import sys; sys.exit(0 if $now-$t0 > 30 else 1)"; then echo "not back after 30 s: $b of $before"; break; fi
  sleep 0.05
done
kill $N; kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$WORK"
