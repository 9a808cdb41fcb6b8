//! `kvmesh replica drain --wait` end to end, as an engine pod's preStop hook runs it: a node in
//! front of one slow engine-sim with a streamed request in flight; the command reports what is
//! left, gives up at its timeout, and returns once the request has ended (then removes it).

mod common;

use kvmesh_engine_sim::EngineSimConfig;
use std::io::BufRead;
use std::process::{Command, Stdio};
use std::time::Duration;

fn drain(grpc: &str, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvmesh"));
    c.args(["replica", "drain", "--grpc", grpc, "--name", "e0"]).args(args);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_wait_returns_once_the_request_in_flight_has_ended() {
    let engine = kvmesh_engine_sim::start(EngineSimConfig { speed: 0.05, ..EngineSimConfig::default() }).await.unwrap();
    let node = kvmesh_node::start(common::config(&engine, 0.05)).await.unwrap();
    common::routable(&node).await;
    // A request that runs until it is dropped (10,000 tokens on a slow engine).
    let body = serde_json::json!({"model": "m", "prompt": "hold ".repeat(200), "max_tokens": 10_000, "stream": true});
    let url = format!("http://{}/v1/completions", node.http);
    let mut response = reqwest::Client::new().post(url).json(&body).send().await.unwrap();
    response.chunk().await.unwrap().unwrap();
    let grpc = format!("http://{}", node.grpc);

    // Registering it again with the same endpoints is a no-op (a start-up script's retry);
    // with others, an error.
    let add = |http: &str| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_kvmesh"));
        c.args(["replica", "add", "--grpc", &grpc, "--name", "e0", "--http", http, "--kv-events"])
            .arg(&engine.kv_events)
            .args(["--capacity-blocks", &common::capacity_blocks().to_string()]);
        c.output().unwrap()
    };
    let again = add(&engine.base_url());
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    assert_eq!(
        String::from_utf8_lossy(&again.stdout),
        "replica e0 already registered with these endpoints: unchanged\n"
    );
    let other = add("http://127.0.0.1:1");
    assert_eq!(other.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&other.stderr).contains("(with other endpoints, capacity, model or rank)"));
    // The same engine under another name: added (a stale entry must not block a new pod), and
    // the caller is told, not only the node's log.
    let kvmesh = |args: &[&str]| Command::new(env!("CARGO_BIN_EXE_kvmesh")).args(args).output().unwrap();
    let capacity = common::capacity_blocks().to_string();
    let http = engine.base_url();
    let twin =
        kvmesh(&["replica", "add", "--grpc", &grpc, "--name", "twin", "--http", &http, "--capacity-blocks", &capacity]);
    assert!(twin.status.success(), "{}", String::from_utf8_lossy(&twin.stderr));
    assert_eq!(
        String::from_utf8_lossy(&twin.stderr),
        format!(
            "warning: twin and replica e0 are one engine ({http}): remove the stale one with `kvmesh replica remove \
             --name e0`\n"
        )
    );
    assert!(kvmesh(&["replica", "remove", "--grpc", &grpc, "--name", "twin"]).status.success());
    // Registered without a capacity (its engine's figure, once read): a retry without one is
    // the same registration, one that sets a figure is not.
    let learned = |extra: &[&str]| {
        let mut args = vec!["replica", "add", "--grpc", &grpc, "--name", "e1", "--http", "http://127.0.0.1:2"];
        args.extend(extra);
        kvmesh(&args)
    };
    let first = learned(&[]);
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    assert!(String::from_utf8_lossy(&first.stdout).starts_with("replica e1 added; starting until its engine reports"));
    assert_eq!(
        String::from_utf8_lossy(&learned(&[]).stdout),
        "replica e1 already registered with these endpoints: unchanged\n"
    );
    assert_eq!(learned(&["--capacity-blocks", &capacity]).status.code(), Some(1));
    assert!(kvmesh(&["replica", "remove", "--grpc", &grpc, "--name", "e1"]).status.success());

    // An unknown replica is named in words, not in gRPC's status dump.
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvmesh"));
    let out = c.args(["replica", "undrain", "--grpc", &grpc, "--name", "nosuch"]).output().unwrap();
    assert_eq!(
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned()),
        (Some(1), "error: Admin.UndrainReplica: unknown replica \"nosuch\"\n".to_string())
    );

    // --timeout and --remove only go with --wait.
    let out = drain(&grpc, &["--timeout", "5"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--wait"), "{err}");

    // It gives up at its timeout, saying what is left; the replica stays draining.
    let out = tokio::task::spawn_blocking({
        let grpc = grpc.clone();
        move || drain(&grpc, &["--wait", "--timeout", "3"]).output().unwrap()
    })
    .await
    .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(124), "{stdout}");
    assert!(stdout.starts_with("replica e0 draining\n"), "{stdout}");
    // It was the only replica: the tier now takes no traffic, and says so.
    assert!(stderr.contains("warning: no replica takes traffic now"), "{stderr}");
    // The request still running (a single node has no drain to settle).
    let left = "not idle: 1 routed by the tier unfinished; the engine reports 1 running, 0 waiting";
    assert!(stdout.contains(&format!("replica e0: {left}\n")), "{stdout}");
    assert!(
        stderr.contains(&format!("replica e0 not idle after 3 s ({left}); it stays draining and registered")),
        "{stderr}"
    );

    // Waiting again: it returns, with exit code 0, once the request is gone, and removes it.
    let mut child = drain(&grpc, &["--wait", "--timeout", "20", "--remove"]).stdout(Stdio::piped()).spawn().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let _ = tx.send(line.unwrap());
        }
    });
    let mut lines = Vec::new();
    while !lines.iter().any(|l: &String| l.ends_with(left)) {
        lines.push(rx.recv_timeout(Duration::from_secs(10)).expect("a progress line"));
    }
    drop(response);
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap()).await.unwrap();
    lines.extend(rx.iter());
    assert!(status.success(), "{lines:?}");
    assert_eq!(lines[0], "replica e0 draining");
    let idle = &lines[lines.len() - 2];
    assert!(idle.starts_with("replica e0 idle after ") && idle.ends_with(" s: safe to release"), "{lines:?}");
    assert_eq!(lines.last().unwrap(), "replica e0 removed");
    assert!(node.shared.core().fleet.bookings().is_empty());
    assert!(node.shared.core().replicas.is_empty());
    node.stop().await;
}
