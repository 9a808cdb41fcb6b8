# Sourced by the load scripts: four kvmesh-engine-sims at --speed 1000 on loopback and a node
# config that follows them. The caller sets B (the binaries' folder) and OUT. Sourcing it sets
# PIDS (every process started: the engines, and whatever the caller appends) and a trap that
# kills them on exit.
#
#   start_four_engines HTTP EVENTS REPLAY    ports HTTP0..3, EVENTS0..3, REPLAY0..3 (prefixes,
#                                            e.g. 1900 → 19000..19003); sets ENGINES and DIRECT
#   four_engines_node_toml HTTP_ADDR GRPC_ADDR  writes $OUT/node.toml for the engines started
#   wait_up URL                              polls URL for up to 10 s

PIDS=()
cleanup() { for p in "${PIDS[@]:-}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

start_four_engines() {
  FOUR_HTTP=$1 FOUR_EVENTS=$2 FOUR_REPLAY=$3
  ENGINES=()
  for i in 0 1 2 3; do
    "$B/kvmesh-engine-sim" --http "127.0.0.1:$FOUR_HTTP$i" --kv-events "tcp://127.0.0.1:$FOUR_EVENTS$i" \
      --replay "tcp://127.0.0.1:$FOUR_REPLAY$i" --speed 1000 >"$OUT/engine$i.log" 2>&1 &
    PIDS+=($!)
    ENGINES+=("http://127.0.0.1:$FOUR_HTTP$i")
  done
  DIRECT=$(IFS=,; echo "${ENGINES[*]}")
  for e in "${ENGINES[@]}"; do wait_up "$e/health"; done
}

four_engines_node_toml() {
  {
    printf '[node]\nhttp = "%s"\ngrpc = "%s"\n' "$1" "$2"
    for i in 0 1 2 3; do
      printf '\n[[replicas]]\nname = "e%s"\nhttp = "http://127.0.0.1:%s%s"\nkv_events = "tcp://127.0.0.1:%s%s"\nreplay = "tcp://127.0.0.1:%s%s"\ncapacity_blocks = 29375\n' \
        "$i" "$FOUR_HTTP" "$i" "$FOUR_EVENTS" "$i" "$FOUR_REPLAY" "$i"
    done
  } >"$OUT/node.toml"
}

wait_up() { for _ in $(seq 100); do curl -sf -o /dev/null "$1" && return 0; sleep 0.1; done; echo "not up: $1" >&2; return 1; }
