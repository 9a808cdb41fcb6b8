//! `kvmesh analyze` as a user runs it: the real binary, real traces, its output and exit codes.

use std::path::PathBuf;
use std::process::{Command, Output};

fn kvmesh(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvmesh")).args(args).output().expect("run kvmesh")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn temp(name: &str, contents: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("kvmesh-cli-{}-{name}", std::process::id()));
    std::fs::write(&path, contents).unwrap();
    path
}

#[test]
fn prints_the_reuse_ratio_of_the_real_traces() {
    for (file, ratio) in [("conversation_trace.jsonl", "0.366"), ("synthetic_trace.jsonl", "0.640")] {
        let Some(path) = kvmesh_tests::trace(&format!("mooncake/{file}")) else { return };
        let out = kvmesh(&["analyze", "--trace", path.to_str().unwrap()]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let stdout = text(&out.stdout);
        let line = stdout.lines().find(|l| l.starts_with("prefix reuse")).unwrap();
        assert!(line.starts_with(&format!("prefix reuse     {ratio} (")), "{line}");
    }
}

#[test]
fn json_output_parses() {
    let Some(path) = kvmesh_tests::trace("mooncake/synthetic_trace.jsonl") else { return };
    let out = kvmesh(&["analyze", "--json", "--trace", path.to_str().unwrap()]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["requests"], 3993);
    assert_eq!(v["prefix"]["reused_refs"], 77953);
}

#[test]
fn runs_on_the_built_in_workload_without_a_trace() {
    let out = kvmesh(&["analyze"]);
    assert!(out.status.success());
    assert!(text(&out.stderr).starts_with("no --trace given: analyzing the built-in generated workload"));
    assert!(text(&out.stdout).starts_with(
        "trace            built-in workload `chat` (generated multi-turn chat, 512-token block ids)\nrequests         1,064 "
    ));
    // The demo's workload, fitted to the Mooncake conversation trace.
    let out = kvmesh(&["analyze", "--workload", "conversation"]);
    let stdout = text(&out.stdout);
    assert!(stdout.contains("fitted to the Mooncake conversation trace"), "{stdout}");
    assert!(stdout.contains("42.5%"), "{stdout}");
    let out = kvmesh(&["analyze", "--workload", "agents"]);
    assert!(text(&out.stderr).contains("unknown --workload \"agents\": use chat or conversation"));
}

#[test]
fn malformed_lines_are_reported_by_number_and_strict_fails() {
    let path =
        temp("bad.jsonl", "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [0]}\n{oops\n");
    let p = path.to_str().unwrap();
    let out = kvmesh(&["analyze", "--trace", p]);
    assert!(out.status.success());
    assert!(
        text(&out.stderr).contains(&format!("warning: skipped {p} line 2: key must be a string")),
        "{}",
        text(&out.stderr)
    );
    let out = kvmesh(&["analyze", "--strict", "--trace", p]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).ends_with(&format!("error: 1 malformed lines in {p} (--strict)\n")));
    std::fs::remove_file(path).unwrap();
}

#[test]
fn unknown_and_missing_files_are_clear_errors() {
    let parquet = temp("trace.parquet", "PAR1");
    let p = parquet.to_str().unwrap();
    let out = kvmesh(&["analyze", "--trace", p]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stderr),
        format!(
            "error: analyzing {p}\n  caused by: unknown trace format for {p}: expected a .jsonl (Mooncake or kvmesh JSONL) or an Azure LLM .csv file\n"
        )
    );
    std::fs::remove_file(parquet).unwrap();
    // A missing file is reported as missing, whatever its name.
    let out = kvmesh(&["analyze", "--trace", "/nonexistent"]);
    assert_eq!(
        text(&out.stderr),
        "error: analyzing /nonexistent\n  caused by: cannot read trace /nonexistent\n  caused by: No such file or directory (os error 2)\n"
    );
    let out = kvmesh(&["analyze", "--trace", "/nonexistent/t.jsonl"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stderr),
        "error: analyzing /nonexistent/t.jsonl\n  caused by: cannot read trace /nonexistent/t.jsonl\n  caused by: No such file or directory (os error 2)\n"
    );
    let out = kvmesh(&["analyze", "--top", "many"]);
    assert_eq!(out.status.code(), Some(2), "usage errors exit 2");
}
