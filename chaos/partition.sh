#!/usr/bin/env bash
# Cut one follower off (injected transport fault: all its Raft and gossip traffic dropped).
# Safety: it keeps routing on its last registry (0 failed requests through it), cannot change
# the configuration; the majority can. Heal: it catches up.
source "$(dirname "$0")/lib.sh"
setup_cluster
leader="$(leader_seen_by 1)"
cut=$(( leader % NODES + 1 ))
other=$(( cut % NODES + 1 ))
start_load 40 8
sleep 1
"$BIN/kvmesh" cluster fault --grpc "$(grpc_of "$cut")" --isolate true >/dev/null
log "isolated node $cut (leader $leader)"
if "$BIN/kvmesh" replica drain --grpc "$(grpc_of "$cut")" --name e1 >"$WORK/minority_write.out" 2>&1; then
  fail "the isolated node accepted a configuration change"
fi
log "minority write refused: $(tail -n 1 "$WORK/minority_write.out")"
"$BIN/kvmesh" replica drain --grpc "$(grpc_of "$other")" --name e1 >/dev/null || fail "majority write failed"
sleep 1
registry_has "$cut" e1 ready || fail "the isolated node saw a change it cannot have received"
check_load
"$BIN/kvmesh" cluster fault --grpc "$(grpc_of "$cut")" --isolate false >/dev/null
wait_for 10 "node $cut to catch up" registry_has "$cut" e1 draining
log "PASS: minority routed with 0 failures, refused writes, caught up after healing"
