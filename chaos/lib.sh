# Shared helpers for the chaos scenarios: a real multi-process cluster on loopback.
#   3 kvmesh router nodes (Raft + gossip), 4 kvmesh-engine-sim replicas, kvmesh loadtest.
# Environment:
#   KVMESH_BIN        directory of the kvmesh and kvmesh-engine-sim binaries (target/debug)
#   CHAOS_DURATION    seconds of load per scenario (default 8; run.sh --long sets 120)
#   CHAOS_PORT_BASE   first port used (default 29000; ~450 ports above it)
#   CHAOS_KEEP        set to keep the work directory (logs, sled data) after the run
#   CHAOS_EXTRA_TOML  extra TOML appended to every node's config (a scenario sets it)
set -euo pipefail

BIN="${KVMESH_BIN:-target/debug}"
DURATION="${CHAOS_DURATION:-8}"
BASE="${CHAOS_PORT_BASE:-29000}"
WORK="$(mktemp -d -t kvmesh-chaos.XXXXXX)"
NODES=3
ENGINES=4
SCENARIO="$(basename "$0" .sh)"
PEERS="$(for i in $(seq 1 $NODES); do printf '%s=127.0.0.1:%s,' "$i" $((BASE + 400 + i)); done)"
PEERS="${PEERS%,}"

log() { printf '[%s %s] %s\n' "$SCENARIO" "$(date +%T.%3N)" "$*"; }

fail() {
  log "FAIL: $*"
  for f in "$WORK"/*.log; do echo "--- $f (last 15 lines)"; tail -n 15 "$f"; done
  exit 1
}

cleanup() {
  for p in "$WORK"/*.pid; do
    [ -f "$p" ] && kill -9 "$(cat "$p")" 2>/dev/null || true
  done
  wait 2>/dev/null || true
  if [ -z "${CHAOS_KEEP:-}" ]; then rm -rf "$WORK"; else log "kept $WORK"; fi
}
trap cleanup EXIT

grpc_of() { echo "127.0.0.1:$((BASE + 400 + $1))"; }
http_of() { echo "http://127.0.0.1:$((BASE + 300 + $1))"; }
all_http() { local u=""; for i in $(seq 1 $NODES); do u="$u$(http_of "$i"),"; done; echo "${u%,}"; }

start_engines() {
  for e in $(seq 0 $((ENGINES - 1))); do
    "$BIN/kvmesh-engine-sim" --http "127.0.0.1:$((BASE + e))" --kv-events "tcp://127.0.0.1:$((BASE + 100 + e))" \
      --replay "tcp://127.0.0.1:$((BASE + 200 + e))" --speed 20 >"$WORK/engine$e.log" 2>&1 &
    disown $!
    echo $! >"$WORK/engine$e.pid"
  done
}

write_config() {
  local i=$1
  {
    printf '[node]\nhttp = "127.0.0.1:%s"\ngrpc = "127.0.0.1:%s"\nscrape_interval = \"200ms\"\n' \
      $((BASE + 300 + i)) $((BASE + 400 + i))
    printf '\n[cluster]\nsummary_interval = \"500ms\"\nallow_fault_injection = true\n'
    printf '\n%s\n' "${CHAOS_EXTRA_TOML:-}"
    for e in $(seq 0 $((ENGINES - 2))); do
      # The last engine is added at runtime through the admin API.
      printf '\n[[replicas]]\nname = "e%s"\nhttp = "http://127.0.0.1:%s"\nkv_events = "tcp://127.0.0.1:%s"\nreplay = "tcp://127.0.0.1:%s"\ncapacity_blocks = 29375\n' \
        "$e" $((BASE + e)) $((BASE + 100 + e)) $((BASE + 200 + e))
    done
  } >"$WORK/n$i.toml"
}

# Every node of the run shares one cluster token (a cluster never runs unauthenticated).
CHAOS_CLUSTER_TOKEN="${CHAOS_CLUSTER_TOKEN:-chaos-$$-$RANDOM$RANDOM}"

start_node() {
  local i=$1
  [ -f "$WORK/n$i.toml" ] || write_config "$i"
  KVMESH_CLUSTER_TOKEN="$CHAOS_CLUSTER_TOKEN" RUST_LOG="${RUST_LOG:-info,openraft=error}" "$BIN/kvmesh" node --config "$WORK/n$i.toml" --id "$i" \
    --peers "$PEERS" --data-dir "$WORK/data$i" >>"$WORK/node$i.log" 2>&1 &
  disown $!
  echo $! >"$WORK/node$i.pid"
}

# kill -9 node $1 and wait until the process is gone (its ports and sled lock are free).
kill_node() {
  local pid; pid="$(cat "$WORK/node$1.pid")"
  kill -9 "$pid" 2>/dev/null || true
  while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
  rm -f "$WORK/node$1.pid"
}

# `kvmesh cluster status --json` of node $1, or nothing if it does not answer.
status_json() { "$BIN/kvmesh" cluster status --grpc "$(grpc_of "$1")" --json 2>/dev/null || true; }

json() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }

# The leader node $1 knows of ("" if none).
leader_seen_by() {
  local s; s="$(status_json "$1")"
  [ -n "$s" ] && echo "$s" | json "d.get('leader_id') or ''" || true
}

# await_new_leader OLD SURVIVOR T0: polls SURVIVOR's view until it names a leader other than
# OLD (at most 10 s), then sets NEW_LEADER and FAILOVER_MS (milliseconds since T0, a
# `date +%s%N` stamp). Globals, not output: `fail` must end the script, not a subshell.
await_new_leader() {
  local old=$1 survivor=$2 t0=$3
  NEW_LEADER=""
  while [ -z "$NEW_LEADER" ] || [ "$NEW_LEADER" = "$old" ]; do
    NEW_LEADER="$(leader_seen_by "$survivor")"
    [ $(( ($(date +%s%N) - t0) / 1000000 )) -lt 10000 ] || fail "no new leader 10 s after killing node $old"
    sleep 0.02
  done
  FAILOVER_MS=$(( ($(date +%s%N) - t0) / 1000000 ))
}

wait_for() { # wait_for SECONDS DESCRIPTION COMMAND...
  local secs=$1 what=$2; shift 2
  local deadline=$(( $(date +%s) + secs ))
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || fail "timed out after ${secs}s waiting for $what"
    sleep 0.1
  done
}

node_up() { "$BIN/kvmesh" cluster status --grpc "$(grpc_of "$1")" >/dev/null 2>&1; }
has_leader() { [ -n "$(leader_seen_by "$1")" ]; }
# Node $1's registry lists replica $2 in state $3.
registry_has() { status_json "$1" | json "any(e['spec']['name']=='$2' and e['state']=='$3' for e in d['registry'])" | grep -q True; }
all_replicas_ready() { "$BIN/kvmesh" status --grpc "http://$(grpc_of "$1")" --json | json "all(r['status']=='REPLICA_STATUS_READY' for r in d['replicas']) and len(d['replicas'])>0" | grep -q True; }

# Starts engines and nodes, bootstraps the cluster, adds the last engine through a follower.
setup_cluster() {
  start_engines
  for i in $(seq 1 $NODES); do start_node "$i"; done
  for i in $(seq 1 $NODES); do wait_for 30 "node $i to answer" node_up "$i"; done
  "$BIN/kvmesh" cluster init --grpc "$(grpc_of 1)" >"$WORK/init.out" || fail "cluster init"
  wait_for 10 "a leader" has_leader 1
  local e=$((ENGINES - 1))
  "$BIN/kvmesh" replica add --grpc "$(grpc_of 2)" --name "e$e" --http "http://127.0.0.1:$((BASE + e))" \
    --kv-events "tcp://127.0.0.1:$((BASE + 100 + e))" --replay "tcp://127.0.0.1:$((BASE + 200 + e))" \
    --capacity-blocks 29375 >/dev/null || fail "replica add through node 2"
  for i in $(seq 1 $NODES); do wait_for 10 "e$e in node $i's registry" registry_has "$i" "e$e" ready; done
  for i in $(seq 1 $NODES); do wait_for 20 "node $i's replicas ready" all_replicas_ready "$i"; done
  log "cluster up: leader $(leader_seen_by 1), $ENGINES replicas, data in $WORK"
}

# Load through every node's OpenAI endpoint, clients retrying once on a refused or reset
# connection. Args: rate max_tokens [distinct system prompts, default 8]. Writes $WORK/load.json.
start_load() {
  "$BIN/kvmesh" loadtest --url "$(all_http)" --rate "$1" --max-tokens "$2" --duration "$DURATION" --warmup 0 \
    --prefixes "${3:-8}" \
    --concurrency 256 --retry-once --json >"$WORK/load.json" 2>"$WORK/load.log" &
  echo $! >"$WORK/load.pid"
}

# Waits for the load generator and fails unless every request succeeded.
check_load() {
  wait "$(cat "$WORK/load.pid")" || true
  rm -f "$WORK/load.pid"
  local r; r="$(cat "$WORK/load.json")"
  log "load: $r"
  echo "$r" | json "d['errors']=={} and d['ok']>0 and d['dropped']==0" | grep -q True || fail "client-visible failures: $r"
}
