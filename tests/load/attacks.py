#!/usr/bin/env python3
"""The hardening attacks of BENCHMARKS.md ("Hardening"), against one kvmesh binary.

Usage: tests/load/attacks.py --kvmesh PATH --engine-sim PATH [--only NAME] [--json]

Each attack starts its own node (and kvmesh-engine-sim engines) on loopback ports, runs,
measures and stops everything:
- kv_flood: two replicas; while `kvmesh loadtest` sends 50 req/s through the node, replica
  e1's KV-event socket (this script's ZMQ PUB, pyzmq) publishes 8 messages of 4 MiB of nils
  (`[ts, [nil × 4,194,280], nil]`). Reports the load's p50/p99/max latency, requests over
  1 s, and the node's peak RSS; and the same load with no attack, in the same run.
- slowloris: the node runs under `ulimit -n 1024`; 1,100 connections each send half a
  request's headers and hold. Reports the node's open descriptors, then the time a fresh
  client's `/health` takes (or that it failed).
- body_flood: 16 clients at once each send a 60 MiB completion body (its prompt is over
  `max_prompt_tokens`, so an admitted one ends in 413 once read). Reports the answers'
  statuses and the node's peak RSS.

Needs pyzmq (`pip install pyzmq`) for kv_flood. Nothing here runs in CI: it is a benchmark.
"""
import argparse
import json
import os
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

BASE = 29700


def wait_http(url, secs=20):
    t0 = time.time()
    while time.time() - t0 < secs:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return True
        except Exception:
            time.sleep(0.1)
    return False


def peak_rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return None


def fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


class Rig:
    """Engines and one node, from a config written here."""

    def __init__(self, args, engines, extra_replicas="", ulimit=None):
        self.args, self.procs, self.dir = args, [], tempfile.mkdtemp(prefix="kvmesh-attack.")
        replicas = ""
        for i in range(engines):
            http, ev, rp = BASE + i, BASE + 100 + i, BASE + 200 + i
            self.spawn([args.engine_sim, "--http", f"127.0.0.1:{http}", "--kv-events", f"tcp://127.0.0.1:{ev}",
                        "--replay", f"tcp://127.0.0.1:{rp}", "--speed", "100"], f"engine{i}")
            replicas += (f'\n[[replicas]]\nname = "e{i}"\nhttp = "http://127.0.0.1:{http}"\n'
                         f'kv_events = "tcp://127.0.0.1:{ev}"\nreplay = "tcp://127.0.0.1:{rp}"\ncapacity_blocks = 29375\n')
        self.http, self.grpc = BASE + 300, BASE + 301
        cfg = (f'[node]\nhttp = "127.0.0.1:{self.http}"\ngrpc = "127.0.0.1:{self.grpc}"\n'
               f'scrape_interval = "200ms"\nengine_speed = 100\n' + replicas + extra_replicas)
        path = os.path.join(self.dir, "node.toml")
        with open(path, "w") as f:
            f.write(cfg)
        cmd = [args.kvmesh, "node", "--config", path]
        if ulimit:
            cmd = ["bash", "-c", f"ulimit -n {ulimit} && exec " + " ".join(cmd)]
        self.node = self.spawn(cmd, "node")
        for i in range(engines):
            wait_http(f"http://127.0.0.1:{BASE + i}/health")
        if not wait_http(f"http://127.0.0.1:{self.http}/health"):
            raise SystemExit("the node did not come up: " + open(os.path.join(self.dir, "node.log")).read()[-2000:])

    def spawn(self, cmd, name):
        log = open(os.path.join(self.dir, f"{name}.log"), "w")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def loadtest(self, seconds=10, rate=50):
        out = subprocess.run([self.args.kvmesh, "loadtest", "--url", f"http://127.0.0.1:{self.http}", "--rate", str(rate),
                              "--duration", str(seconds), "--warmup", "0", "--json"], capture_output=True, text=True)
        return json.loads(out.stdout)

    def stop(self):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def nil_message(seq, n):
    payload = b"\x93\xcb" + struct.pack(">d", time.time()) + b"\xdd" + struct.pack(">I", n) + b"\xc0" * n + b"\xc0"
    return [b"", struct.pack(">Q", seq), payload]


def kv_flood(args):
    import zmq
    ev = BASE + 150
    extra = (f'\n[[replicas]]\nname = "e1"\nhttp = "http://127.0.0.1:{BASE + 1}"\n'
             f'kv_events = "tcp://127.0.0.1:{ev}"\ncapacity_blocks = 29375\n')
    # Engine e1 serves requests; its KV events come from this script instead.
    rig = Rig(args, 1, extra)
    rig.spawn([args.engine_sim, "--http", f"127.0.0.1:{BASE + 1}", "--kv-events", f"tcp://127.0.0.1:{BASE + 101}",
               "--speed", "100"], "engine1")
    wait_http(f"http://127.0.0.1:{BASE + 1}/health")
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{ev}")
    time.sleep(2)
    quiet = rig.loadtest(8)
    rss_quiet = peak_rss_mb(rig.node.pid)
    stop = threading.Event()

    def flood():
        time.sleep(1)
        for seq in range(8):
            if stop.is_set():
                return
            pub.send_multipart(nil_message(seq + 1, 4_194_280))
            time.sleep(0.5)

    t = threading.Thread(target=flood)
    t.start()
    attacked = rig.loadtest(8)
    stop.set()
    t.join()
    rss = peak_rss_mb(rig.node.pid)
    status = subprocess.run([args.kvmesh, "status", "--grpc", f"http://127.0.0.1:{rig.grpc}"], capture_output=True,
                            text=True).stdout
    rig.stop()
    row = lambda r: {k: r.get(k) for k in ("ok", "dropped", "p50_ms", "p99_ms", "max_ms", "errors")}
    return {"quiet": row(quiet), "attacked": row(attacked), "peak_rss_mb_quiet": rss_quiet, "peak_rss_mb": rss,
            "e1_status": next((l for l in status.splitlines() if l.startswith("e1")), "").split()[:2]}


def slowloris(args):
    rig = Rig(args, 1, ulimit=1024)
    held = []
    refused = 0
    for _ in range(1100):
        try:
            s = socket.create_connection(("127.0.0.1", rig.http), timeout=2)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
            held.append(s)
        except OSError:
            refused += 1
    time.sleep(1)
    node_fds = fds(rig.node.pid)
    t0 = time.time()
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{rig.http}/health", timeout=30).read()
        health = f"200 in {time.time() - t0:.2f} s"
    except Exception as e:
        health = f"failed after {time.time() - t0:.1f} s ({type(e).__name__})"
    time.sleep(11)
    fds_after = fds(rig.node.pid)
    for s in held:
        s.close()
    rig.stop()
    return {"connections_held": len(held), "connect_failures": refused, "node_fds": node_fds,
            "health": health, "node_fds_after_11s": fds_after}


def body_flood(args):
    rig = Rig(args, 1)
    n = 60 << 20
    prefix = b'{"model":"m","prompt":"'
    suffix = b'","max_tokens":1}'
    length = len(prefix) + n + len(suffix)
    statuses = []
    lock = threading.Lock()

    def send():
        # Headers first, then the body; a node that refuses it answers, perhaps mid-body.
        s = socket.create_connection(("127.0.0.1", rig.http), timeout=120)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  + f"content-length: {length}\r\n\r\n".encode())
        code = None
        try:
            ready, _, _ = select.select([s], [], [], 0.5)
            if not ready:
                s.sendall(prefix)
                chunk = b"a" * (1 << 20)
                for _ in range(n >> 20):
                    s.sendall(chunk)
                s.sendall(suffix)
        except OSError:
            pass  # refused mid-body: the answer may be waiting to be read
        try:
            line = s.makefile("rb").readline().decode()
            code = line.split()[1] if line else "closed"
        except OSError as e:
            code = type(e).__name__
        finally:
            s.close()
        with lock:
            statuses.append(code)

    ts = [threading.Thread(target=send) for _ in range(16)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    rss = peak_rss_mb(rig.node.pid)
    rig.stop()
    counts = {}
    for s in statuses:
        counts[str(s)] = counts.get(str(s), 0) + 1
    return {"statuses": counts, "peak_rss_mb": rss}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvmesh", required=True)
    ap.add_argument("--engine-sim", required=True)
    ap.add_argument("--only")
    args = ap.parse_args()
    out = {}
    for name, f in [("kv_flood", kv_flood), ("slowloris", slowloris), ("body_flood", body_flood)]:
        if args.only and args.only != name:
            continue
        out[name] = f(args)
        print(name, json.dumps(out[name]), flush=True)


if __name__ == "__main__":
    sys.exit(main())
