#!/usr/bin/env bash
# Kill -9 every node, then restart them all: the registry and configuration come back from
# sled, a leader is elected without a new init, and traffic flows.
source "$(dirname "$0")/lib.sh"
setup_cluster
"$BIN/kvmesh" replica drain --grpc "$(grpc_of 3)" --name e0 >/dev/null || fail "drain e0"
wait_for 10 "e0 draining" registry_has 1 e0 draining
for i in $(seq 1 $NODES); do kill_node "$i"; done
log "killed every node"
for i in $(seq 1 $NODES); do start_node "$i"; done
for i in $(seq 1 $NODES); do wait_for 30 "node $i with a leader" has_leader "$i"; done
for i in $(seq 1 $NODES); do
  wait_for 10 "node $i's e0 draining state back" registry_has "$i" e0 draining
  wait_for 10 "node $i's runtime-added replica back" registry_has "$i" "e$((ENGINES - 1))" ready
done
start_load 30 8
check_load
log "PASS: registry and configuration restored from sled on all $NODES nodes"
