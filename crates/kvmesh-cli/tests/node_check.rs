//! `kvmesh node --check` as an operator runs it on a config file before a rollout.

use std::process::{Command, Output};

fn check(toml: &str, extra: &[&str]) -> Output {
    check_with(toml, extra, &[])
}

/// `--check` with `env` set (and no other token variable).
fn check_with(toml: &str, extra: &[&str], env: &[(&str, &str)]) -> Output {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kvmesh.toml");
    std::fs::write(&path, toml).unwrap();
    Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args(["node", "--config", path.to_str().unwrap(), "--check"])
        .args(extra)
        .env_remove("KVMESH_CLUSTER_TOKEN")
        .env_remove("KVMESH_ADMIN_TOKEN")
        .env_remove("KVMESH_EVENTS_TOKEN")
        .envs(env.iter().copied())
        .output()
        .expect("run kvmesh")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

const REPLICA: &str = "[[replicas]]\nname = \"vllm-0\"\nhttp = \"http://10.0.0.7:8000\"\ncapacity_blocks = 100\n";

#[test]
fn a_valid_file_says_what_would_run_and_its_warnings() {
    let out = check(&format!("[node]\nhttp = \"127.0.0.1:8080\"\nbooking_lease = \"5m\"\n{REPLICA}"), &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(
        lines[0].ends_with(": ok — policy token_load, 1 replica(s), HTTP 127.0.0.1:8080, gRPC 0.0.0.0:50051"),
        "{stdout}"
    );
    assert_eq!(lines.len(), 2, "{stdout}");
    assert!(
        lines[1].starts_with("warning: node.booking_lease (\"5m\") is shorter than node.request_timeout"),
        "{stdout}"
    );
    // A policy written with dashes is named as metrics and the cluster name it.
    let out = check(&format!("[node]\npolicy = \"power-of-two\"\n{REPLICA}"), &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).lines().next().unwrap().contains(": ok — policy power_of_two, 1 replica(s)"));
    // The services a file turns on are listed.
    let on = "[autoscaler]\nenabled = true\nmin_replicas = 2\nmax_replicas = 6\n[admission]\nenabled = true\n\
              ttft_slo = \"2s\"\n[replication]\nenabled = true\n";
    let out = check(&format!("{REPLICA}{on}"), &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert_eq!(
        stdout.lines().nth(1),
        Some("also on: autoscaler (2–6 replicas), admission (queue ≤ 256, TTFT SLO 2s), hot-prefix replication"),
        "{stdout}"
    );
}

#[test]
fn a_refused_file_exits_1_with_the_reason() {
    // An old duration key: the new key and value to write.
    let out = check(&format!("[node]\nscrape_interval_ms = 250\n{REPLICA}"), &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("hint: durations are text now: write scrape_interval = \"250ms\""));
    // A cluster with no cluster token, mTLS or --insecure: refused before any port is bound.
    let out = check(&format!("[cluster]\nid = 1\n{REPLICA}"), &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("[cluster] without authentication"), "{}", text(&out.stderr));
    // --insecure makes it valid, and the flags apply as at a real start.
    let out = check(&format!("[cluster]\nid = 1\n{REPLICA}"), &["--insecure", "--grpc", "127.0.0.1:7001"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("gRPC 127.0.0.1:7001, cluster node 1 (0 configured peer(s))"), "{stdout}");
    assert!(stdout.contains("warning: cluster running INSECURE (--insecure)"), "{stdout}");
    // A token file that is not there: named by its key, at its line.
    let out = check(&format!("[security]\nadmin_token_file = \"/nonexistent/admin-token\"\n{REPLICA}"), &[]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains(
            "kvmesh.toml:2: security.admin_token_file names /nonexistent/admin-token, which cannot be read: No such \
             file or directory (os error 2); fix the path, or remove the key"
        ),
        "{stderr}"
    );
    // With its environment variable set, the node reads the token from there: no file to check.
    let out = check_with(
        &format!("[security]\nadmin_token_file = \"/nonexistent/admin-token\"\n{REPLICA}"),
        &[],
        &[("KVMESH_ADMIN_TOKEN", "a-long-enough-admin-token-0123456789")],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    // A tokenizer file that is there but does not load: refused here as at a real start.
    let exe = env!("CARGO_BIN_EXE_kvmesh");
    let out = check(&format!("[node]\ntokenizer = \"{exe}\"\n{REPLICA}"), &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains(&format!("node.tokenizer: loading tokenizer {exe}")), "{}", text(&out.stderr));
    // Missing files are refused with the file's other refusals, not after them.
    let out = check(
        &format!(
            "[node]\ntokenizer = \"/nonexistent/tokenizer.json\"\n[security]\nadmin_token_file = \"/nonexistent/t\"\n{}",
            REPLICA.replace("http://10.0.0.7:8000", "ftp://10.0.0.7:8000")
        ),
        &[],
    );
    let stderr = text(&out.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 3, "{stderr}");
    assert!(lines[0].contains("kvmesh.toml:7: replica \"vllm-0\": http "), "{stderr}");
    assert!(lines[1].contains("kvmesh.toml:4: security.admin_token_file names /nonexistent/t, which"), "{stderr}");
    assert!(lines[2].contains("kvmesh.toml:2: node.tokenizer names /nonexistent/tokenizer.json, which"), "{stderr}");
    // A refused value names the file's line that sets it.
    let out =
        check(&format!("[node]\nblock_size = 16\n\n{}", REPLICA.replace("= 100", "= 0\nengine = \"sglang\"")), &[]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("kvmesh.toml:7: replica \"vllm-0\": capacity_blocks is required for an sglang engine"),
        "{stderr}"
    );
    let out = check(&format!("[node]\n\nproxy_threads = 0\n{REPLICA}"), &[]);
    let stderr = text(&out.stderr);
    assert!(stderr.contains("kvmesh.toml:3: node.proxy_threads must be at least 1"), "{stderr}");
    // Every part's refusal at once, in order, each at its line.
    let out = check(
        &format!(
            "[node]\nproxy_threads = 0\n[limits]\nhttp_max_connections = 0\n{}",
            REPLICA.replace("= 100", "= 0\nengine = \"sglang\"")
        ),
        &[],
    );
    let stderr = text(&out.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 3, "{stderr}");
    assert!(
        lines[0].starts_with("error: ") && lines[0].ends_with("kvmesh.toml:2: node.proxy_threads must be at least 1")
    );
    assert!(lines[1].ends_with("kvmesh.toml:4: limits.http_max_connections must be positive"), "{stderr}");
    assert!(
        lines[2].contains("kvmesh.toml:8: replica \"vllm-0\": capacity_blocks is required for an sglang engine"),
        "{stderr}"
    );
}
