#!/usr/bin/env bash
# One replica's KV-event stream turns hostile while the tier serves.
# Load: the same steady traffic through every node twice, first with every stream sound, then
# while engine e1 turns hostile one second in: every 500 ms, besides its real messages, a
# 4 MiB batch of nils (kvmesh-engine-sim's `hostile_events` fault; the message that once
# stalled every node that follows the replica for ~11 s).
# Safety: no client-visible failure; every node quarantines e1 (`bad_events`: its messages
# refused from their bytes, never decoded, then its stream not followed) and keeps the other
# replicas ready; the load's p99, the attack's onset included, stays under 3× the quiet
# run's plus 50 ms — a gate against the stall this attack once caused (12–13 s), loose
# enough for debug builds on a busy CI machine. The figure itself (release build of e1af685,
# ten rounds of 40 s: median +5 %, at most +11.5 %; a control of two quiet runs −5.5 … +2.4 %)
# is a benchmark, in BENCHMARKS.md, not a gate.
# Heal: once the stream is sound again, e1 leaves quarantine by itself (here after 12 s).
export CHAOS_EXTRA_TOML='[limits]
kv_event_quarantine = "12s"'
source "$(dirname "$0")/lib.sh"

p99() { json "d['p99_ms']" <"$WORK/load.json"; }
# The worst p99 among the replicas other than e1 (each request's serving replica is in the
# node's x-kvmesh-replica answer header; kvmesh loadtest tallies by it).
others_p99() { json "max((v['p99_ms'] for k, v in d.get('by_replica', {}).items() if k != 'e1'), default=float('nan'))" <"$WORK/load.json"; }
statuses() { "$BIN/kvmesh" status --grpc "http://$(grpc_of "$1")" --json | json "sorted((r['spec']['name'], r['status']) for r in d['replicas'])"; }
e1_is() { "$BIN/kvmesh" status --grpc "http://$(grpc_of "$1")" --json | json "[r['status'] for r in d['replicas'] if r['spec']['name']=='e1']==['REPLICA_STATUS_' + '$2'.upper()]" | grep -q True; }
others_ready() { "$BIN/kvmesh" status --grpc "http://$(grpc_of "$1")" --json | json "all(r['status']=='REPLICA_STATUS_READY' for r in d['replicas'] if r['spec']['name']!='e1')" | grep -q True; }
hostile() {
  python3 -c "import sys, urllib.request as u; u.urlopen(u.Request(sys.argv[1], data=sys.argv[2].encode(), headers={'content-type': 'application/json'}), timeout=5)" \
    "http://127.0.0.1:$((BASE + 1))/admin/faults" "{\"hostile_events\": $1}" || fail "setting e1's faults"
}

# KV_FLOOD_ROUNDS (default 1) repeats the quiet and hostile runs, recovery between, on the
# same cluster: the benchmark (BENCHMARKS.md) runs several rounds of a longer CHAOS_DURATION.
# KV_FLOOD_CONTROL=1 keeps e1 sound in the second run too: the same two runs, nothing hostile,
# to measure how far two quiet runs differ on this machine (the noise the figure sits in).
ROUNDS="${KV_FLOOD_ROUNDS:-1}"
CONTROL="${KV_FLOOD_CONTROL:-0}"
setup_cluster
pairs=""
for round in $(seq 1 "$ROUNDS"); do
  start_load 40 8
  check_load
  quiet="$(p99)"
  quiet_others="$(others_p99)"
  # e1 publishes (and so turns hostile) only while it serves: the load runs throughout.
  start_load 40 8
  sleep 1
  if [ "$CONTROL" = 1 ]; then
    check_load
    log "round $round (control, e1 sound): p99 ${quiet} → $(p99) ms; worst other replica's p99 ${quiet_others} → $(others_p99) ms"
    pairs="$pairs ${quiet}/$(p99)"
    continue
  fi
  hostile true
  for i in $(seq 1 $NODES); do wait_for 7 "node $i to quarantine e1" e1_is "$i" bad_events; done
  check_load
  attacked="$(p99)"
  attacked_others="$(others_p99)"
  for i in $(seq 1 $NODES); do others_ready "$i" || fail "node $i: the other replicas are not ready: $(statuses "$i")"; done
  log "round $round: p99 quiet ${quiet} ms, e1 hostile ${attacked} ms; worst other replica's p99 ${quiet_others} → ${attacked_others} ms"
  pairs="$pairs ${quiet}/${attacked}"
  python3 -c "import sys; q, a = float(sys.argv[1]), float(sys.argv[2]); sys.exit(0 if a <= 3 * q + 50 else 1)" \
    "$quiet" "$attacked" || fail "the hostile stream moved the others' p99: ${quiet} → ${attacked} ms"
  hostile false
  for i in $(seq 1 $NODES); do wait_for 40 "node $i to let e1 out of quarantine" e1_is "$i" ready; done
done
[ "$CONTROL" = 1 ] && { log "PASS (control): p99 quiet/quiet (ms):$pairs"; exit 0; }
log "PASS: e1's hostile stream quarantined on every node; p99 quiet/hostile (ms):$pairs; e1 recovered"
