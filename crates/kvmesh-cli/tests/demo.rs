//! `kvmesh demo` end to end: a small tier (3 Raft nodes, 2 engine-sims) driven by the built-in
//! workload, every request answered, report files written.

use std::process::Command;

#[test]
fn a_small_demo_serves_every_request_and_writes_its_reports() {
    let out_dir = std::env::temp_dir().join(format!("kvmesh-demo-test-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args(["demo", "--requests", "40", "--replicas", "2", "--rate", "8", "--speed", "4", "--quiet", "--out"])
        .arg(&out_dir)
        .output()
        .expect("run kvmesh demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<&str> = stdout
        .lines()
        .map(str::trim_start)
        .filter(|l| l.starts_with("token_load ") || l.starts_with("round_robin "))
        .filter(|l| l.split_whitespace().nth(1).is_some_and(|c| c.parse::<u32>().is_ok()))
        .collect();
    assert_eq!(rows.len(), 2, "{stdout}");
    for row in rows {
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert_eq!((cols[1], cols[2]), ("40", "0"), "40 requests, 0 errors: {row}");
    }
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["results"].as_array().unwrap().len(), 2);
    let csv = std::fs::read_to_string(out_dir.join("requests-token_load.csv")).unwrap();
    assert_eq!(csv.lines().count(), 41, "a header and one line per request");
    assert!(csv.lines().skip(1).all(|l| l.split(',').nth(2).is_some_and(|r| r == "e0" || r == "e1")), "{csv}");
    let _ = std::fs::remove_dir_all(&out_dir);
}

#[test]
fn bad_demo_flags_are_clear_errors() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvmesh")).args(["demo", "--policy", "fastest"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown policy \"fastest\""), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_kvmesh")).args(["demo", "--speed", "0"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("--speed must be a positive number"));
}
