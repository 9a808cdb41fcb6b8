#!/usr/bin/env bash
# Kill -9 the Raft leader while it replicates a hot prefix.
# Load: one system prompt on every request (hot), through every node.
# Safety: the committed replication plan survives — the new leader serves the same prefix with
# its confirmed targets still confirmed (no re-planning from scratch); no client-visible failure.
# Heal: the killed node restarts from its sled files with the plan.
export CHAOS_EXTRA_TOML='[replication]
enabled = true
interval = "200ms"
cooldown = "2m"'
source "$(dirname "$0")/lib.sh"

# `kvmesh replication status --json` of node $1 piped through a Python expression on it (d).
rep() { "$BIN/kvmesh" replication status --grpc "http://$(grpc_of "$1")" --json 2>/dev/null | json "$2"; }
planned_and_confirmed() {
  rep "$1" "any(t['state']=='confirmed' for p in d['plan']['prefixes'] for t in p['targets'])" | grep -q True
}

setup_cluster
start_load 40 8 1
wait_for 20 "a confirmed replication target" planned_and_confirmed 1
old="$(leader_seen_by 1)"
[ -n "$old" ] || fail "no leader before the kill"
survivor=$(( old % NODES + 1 ))
hash="$(rep "$survivor" "d['plan']['prefixes'][0]['hash']")"
version="$(rep "$survivor" "d['plan']['version']")"
confirmed="$(rep "$survivor" "sorted(t['replica'] for p in d['plan']['prefixes'] for t in p['targets'] if t['state']=='confirmed')")"
log "plan v$version: prefix $hash, confirmed on $confirmed; killing leader $old"
kill_node "$old"
t0=$(date +%s%N)
await_new_leader "$old" "$survivor" "$t0"
new=$NEW_LEADER
log "node $new leads after $FAILOVER_MS ms"
# Let the new leader run a few planning rounds under the same load.
sleep 2
after_hash="$(rep "$new" "[p['hash'] for p in d['plan']['prefixes']]")"
after_version="$(rep "$new" "d['plan']['version']")"
still="$(rep "$new" "sorted(t['replica'] for p in d['plan']['prefixes'] for t in p['targets'] if t['state']=='confirmed')")"
echo "$after_hash" | grep -q "$hash" || fail "the new leader's plan lost prefix $hash: $after_hash"
[ "$after_version" -ge "$version" ] || fail "the plan went back from v$version to v$after_version"
python3 -c "import sys; a=set($confirmed); b=set($still); sys.exit(0 if a <= b else 1)" \
  || fail "confirmed targets $confirmed became $still under the new leader"
check_load
start_node "$old"
wait_for 20 "node $old back with a leader" has_leader "$old"
wait_for 10 "node $old holding the plan" bash -c "$(declare -f rep json); BIN='$BIN'; grpc_of() { echo 127.0.0.1:\$(( $BASE + 400 + \$1 )); }; rep $old \"[p['hash'] for p in d['plan']['prefixes']]\" | grep -q $hash"
log "PASS: plan v$version (prefix $hash) survived the kill of leader $old; now v$after_version, confirmed on $still"
