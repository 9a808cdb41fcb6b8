//! `kvmesh replay` as a user runs it: the real binary on a small scenario and a real trace.

use std::process::{Command, Output};

fn kvmesh(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvmesh")).args(args).output().expect("run kvmesh")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn scenario_table_lists_every_policy_and_same_seed_gives_same_numbers() {
    let args = ["replay", "--scenario", "hot-prompt", "--requests", "200", "--replicas", "2", "--rate", "5", "--quiet"];
    let a = kvmesh(&args);
    assert!(a.status.success(), "{}", text(&a.stderr));
    let out = text(&a.stdout);
    assert!(out.starts_with("scenario hot-prompt (200 requests at 5 req/s) — 200 requests"), "{out}");
    for p in ["round_robin", "cache_aware", "kv_cost", "weighted_scorer", "token_load"] {
        assert!(out.lines().any(|l| l.starts_with(p)), "{p} missing:\n{out}");
    }
    let b = kvmesh(&args);
    let strip = |s: &str| s.lines().filter(|l| !l.starts_with("simulated")).collect::<Vec<_>>().join("\n");
    assert_eq!(strip(&out), strip(&text(&b.stdout)), "same seed, same numbers");
}

#[test]
fn json_and_markdown_outputs() {
    let out = kvmesh(&[
        "replay",
        "--scenario",
        "shared-50",
        "--requests",
        "100",
        "--replicas",
        "2",
        "--policies",
        "token_load,random",
        "--seeds",
        "2",
        "--json",
        "--quiet",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["results"].as_array().unwrap().len(), 2);
    assert_eq!(v["results"][0]["policy"], "token_load");
    assert_eq!(v["results"][0]["per_seed"].as_array().unwrap().len(), 2);
    assert_eq!(v["results"][0]["mean"]["completed"], 100);
    let md = text(
        &kvmesh(&[
            "replay",
            "--scenario",
            "zipf",
            "--requests",
            "50",
            "--replicas",
            "2",
            "--policies",
            "kv_cost",
            "--markdown",
            "--quiet",
        ])
        .stdout,
    );
    assert!(md.contains("| policy | TTFT p50 |") && md.contains("\n| kv_cost | "), "{md}");
}

#[test]
fn a_real_trace_replays_with_a_plot() {
    let Some(path) = kvmesh_tests::trace("mooncake/synthetic_trace.jsonl") else { return };
    let svg = std::env::temp_dir().join(format!("kvmesh-replay-{}.svg", std::process::id()));
    let out = kvmesh(&[
        "replay",
        "--trace",
        path.to_str().unwrap(),
        "--requests",
        "300",
        "--replicas",
        "4",
        "--policies",
        "token_load,round_robin",
        "--rate-scale",
        "4",
        "--plot",
        svg.to_str().unwrap(),
        "--quiet",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains(" — 300 requests over "));
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(plot.starts_with("<svg") && plot.contains("token_load") && plot.contains("round_robin"));
    std::fs::remove_file(svg).unwrap();
}

#[test]
fn bad_arguments_are_clear_errors() {
    let out = kvmesh(&["replay", "--scenario", "nope"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).starts_with("error: unknown scenario \"nope\"; known: shared-0, shared-50"));
    let out = kvmesh(&["replay", "--scenario", "chat", "--policies", "fastest"]);
    assert!(text(&out.stderr).starts_with("error: unknown policy \"fastest\""));
    let out = kvmesh(&["replay", "--scenario", "chat", "--profile", "/nonexistent.json"]);
    assert!(
        text(&out.stderr).starts_with("error: profile \"/nonexistent.json\" is neither h100, a100 nor a readable file")
    );
    let out = kvmesh(&["replay", "--scenario", "chat", "--rate-scale", "0"]);
    assert!(text(&out.stderr).starts_with("error: rate scale must be a positive number, got 0"));
}

#[test]
fn flag_values_that_cannot_simulate_are_rejected_up_front() {
    for (args, msg) in [
        (&["--block-size", "0"][..], "error: --block-size must be at least 1 token\n"),
        (&["--replicas", "0"][..], "error: --replicas must be at least 1\n"),
        (&["--rate", "0"][..], "error: --rate must be a positive number of requests per second, got 0\n"),
        (&["--event-delay-ms", "-5"][..], "error: --event-delay-ms must be a non-negative number, got -5\n"),
    ] {
        let mut all = vec!["replay", "--scenario", "chat", "--quiet"];
        all.extend_from_slice(args);
        let out = kvmesh(&all);
        assert_eq!((out.status.code(), text(&out.stderr)), (Some(1), msg.to_string()), "{args:?}");
    }
    let out = kvmesh(&["replay", "--trace", "x.jsonl", "--rate", "5"]);
    assert_eq!(text(&out.stderr), "error: --rate sets a scenario's arrival rate; for a trace use --rate-scale\n");
}

#[test]
fn a_bad_plot_path_still_prints_the_results() {
    let out = kvmesh(&[
        "replay",
        "--scenario",
        "zipf",
        "--requests",
        "50",
        "--replicas",
        "2",
        "--policies",
        "random",
        "--plot",
        "/nonexistent/dir/x.svg",
        "--quiet",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stdout).contains("\nrandom "), "{}", text(&out.stdout));
    assert!(text(&out.stderr).starts_with("error: writing the TTFT plot /nonexistent/dir/x.svg"));
}
