#!/usr/bin/env bash
# Kill -9 the Raft leader under load.
# Safety: a new leader within 2 s; no client-visible failure (clients retry once on a refused
# or reset connection); the committed configuration survives.
# Heal: the killed node restarts from its sled files and catches up.
source "$(dirname "$0")/lib.sh"
setup_cluster
start_load 40 8
sleep "$(( DURATION / 3 ))"
old="$(leader_seen_by 1)"
[ -n "$old" ] || fail "no leader before the kill"
t0=$(date +%s%N)
kill_node "$old"
survivor=$(( old % NODES + 1 ))
await_new_leader "$old" "$survivor" "$t0"
new=$NEW_LEADER
ms=$FAILOVER_MS
log "killed leader $old; node $new leads after $ms ms"
[ "$ms" -le 2000 ] || fail "failover took $ms ms (> 2000)"
check_load
for i in $(seq 1 $NODES); do
  [ "$i" = "$old" ] && continue
  registry_has "$i" "e$((ENGINES - 1))" ready || fail "node $i lost the committed replica"
done
# Heal: the old leader comes back from its sled files as a follower.
start_node "$old"
wait_for 20 "node $old back with a leader" has_leader "$old"
wait_for 10 "node $old's registry" registry_has "$old" "e$((ENGINES - 1))" ready
log "PASS: failover $ms ms, 0 failed requests, node $old rejoined"
