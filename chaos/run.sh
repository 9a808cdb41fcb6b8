#!/usr/bin/env bash
# Runs every chaos scenario against a real multi-process cluster.
#   chaos/run.sh           short versions (CI): 8 s of load each
#   chaos/run.sh --long    soak versions: 120 s of load each
# Builds the binaries first unless KVMESH_BIN points at existing ones.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--long" ]; then export CHAOS_DURATION="${CHAOS_DURATION:-120}"; fi
if [ -z "${KVMESH_BIN:-}" ]; then
  cargo build --quiet --locked -p kvmesh-cli -p kvmesh-engine-sim
  export KVMESH_BIN=target/debug
fi
for s in leader_kill partition restart_all gossip_drop replication_leader_kill autoscaler_leader_kill kv_flood; do
  echo "== chaos: $s =="
  bash "chaos/$s.sh"
done
echo "chaos: all scenarios passed"
