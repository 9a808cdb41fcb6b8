//! `kvmesh autoscaler recommend` and `watch` end to end: a single node with the autoscaler on
//! in front of one idle engine-sim; the latest decision as a table and as JSON (also in
//! `status --json`), and the stream an actuator follows.

mod common;

use kvmesh_engine_sim::EngineSimConfig;
use std::io::BufRead;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn autoscaler(grpc: &str, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvmesh"));
    c.arg("autoscaler").args(args).args(["--grpc", grpc]);
    c
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recommend_and_watch_show_the_committed_decision() {
    let engine = kvmesh_engine_sim::start(EngineSimConfig::default()).await.unwrap();
    let mut config = common::config(&engine, 1.0);
    config.autoscaler.enabled = true;
    config.autoscaler.policy.interval_s = 0.2;
    let node = kvmesh_node::start(config).await.unwrap();
    common::routable(&node).await;
    let grpc = format!("http://{}", node.grpc);

    // The first decision comes one interval after the start (until then `recommend` fails),
    // and may predate the replica's first scrape (0 ready): wait for one that counts it.
    let t0 = Instant::now();
    let latest = loop {
        let out = autoscaler(&grpc, &["recommend", "--json"]).output().unwrap();
        if out.status.success() {
            let d = serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap();
            if d["ready"] == 1 {
                break d;
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "no decision: {}", String::from_utf8_lossy(&out.stderr));
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // One idle replica, the fewest allowed: hold at 1.
    assert_eq!(latest["pool"], "default");
    assert_eq!(latest["desired_replicas"], 1);
    assert_eq!(latest["reason"], "hold");
    assert_eq!(latest["starting"], 0);
    assert_eq!(latest["panic"], false);

    let table = text(&autoscaler(&grpc, &["recommend"]).output().unwrap());
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(
        lines[0],
        "log index      ago  desired  reason             ready starting   demand tok/s    sized tok/s  tok/s/replica"
    );
    let cells: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!((cells[2], cells[3], cells[4], cells[5], cells[6]), ("1", "hold", "1", "0", "0"), "{table}");

    // `status --json` carries it too, with the replicas, the admission queue and the latest
    // decisions: one request routed first.
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", node.http))
        .json(&serde_json::json!({"model": "m", "prompt": "hello there", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let mut status = Command::new(env!("CARGO_BIN_EXE_kvmesh"));
    let status = status.args(["status", "--json", "--grpc", &grpc]).output().unwrap();
    let all: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    // Each part is the node's gRPC message in the proto3 JSON mapping: enums by name, 64-bit
    // integers as strings, defaults printed.
    assert_eq!(all["replicas"][0]["spec"]["name"], "e0");
    assert_eq!(all["replicas"][0]["status"], "REPLICA_STATUS_READY");
    assert!(all["replicas"][0]["index_blocks"].is_string(), "{all}");
    assert_eq!(all["replicas"].as_array().unwrap().len(), 1);
    assert_eq!(
        (&all["admission"]["enabled"], &all["admission"]["ttft_slo_s"]),
        (&false.into(), &serde_json::Value::from(0.0))
    );
    assert_eq!((&all["autoscaler"]["desired_replicas"], &all["autoscaler"]["reason"]), (&1.into(), &"hold".into()));
    assert_eq!(all["decisions"].as_array().unwrap().len(), 1, "{all}");
    assert_eq!((&all["decisions"][0]["via"], &all["decisions"][0]["replica"]), (&"http".into(), &"e0".into()));

    // `watch` prints the latest decision first (then each newer one); it ends when its reader
    // goes away.
    let mut watch = autoscaler(&grpc, &["watch", "--json"]).stdout(Stdio::piped()).spawn().unwrap();
    let mut out = std::io::BufReader::new(watch.stdout.take().unwrap()).lines();
    let first: serde_json::Value = serde_json::from_str(&out.next().unwrap().unwrap()).unwrap();
    for key in ["pool", "desired_replicas", "reason", "ready", "starting", "capacity_tokens_per_s"] {
        assert_eq!(first[key], latest[key], "{key}: {first} against {latest}");
    }
    drop(out);
    // The closed pipe shows on the next write, at the next decision: draining the replica
    // changes the pool's ready count, so one commits within an interval (rather than in 30 s).
    let mut drain = Command::new(env!("CARGO_BIN_EXE_kvmesh"));
    let drained = drain.args(["replica", "drain", "--grpc", &grpc, "--name", "e0"]).output().unwrap();
    assert!(drained.status.success(), "{}", String::from_utf8_lossy(&drained.stderr));
    let t0 = Instant::now();
    while watch.try_wait().unwrap().is_none() {
        assert!(t0.elapsed() < Duration::from_secs(20), "watch kept running without a reader");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(watch.wait().unwrap().success());

    // An unknown pool is an error naming it.
    let other = autoscaler(&grpc, &["recommend", "--pool", "gpu-b"]).output().unwrap();
    assert_eq!(other.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&other.stderr).contains("gpu-b"), "{}", String::from_utf8_lossy(&other.stderr));
    node.stop().await;
    engine.stop().await;
}
