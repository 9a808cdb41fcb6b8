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
        assert!(out.lines().any(|l| l.trim_start().starts_with(p)), "{p} missing:\n{out}");
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
fn rate_steps_split_the_replayed_slice_not_the_whole_trace() {
    let Some(path) = kvmesh_tests::trace("mooncake/synthetic_trace.jsonl") else { return };
    let run = |steps: Option<&str>| {
        let mut args = vec!["replay", "--trace", path.to_str().unwrap(), "--requests", "300", "--replicas", "4"];
        args.extend(["--policies", "token_load", "--rate-scale", "4", "--json", "--quiet"]);
        args.extend(steps.map(|s| ["--rate-steps", s]).into_iter().flatten());
        let out = kvmesh(&args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let (flat, stepped) = (run(None), run(Some("1,3,1")));
    let span = |v: &serde_json::Value| v["span_s"].as_f64().unwrap();
    // The 300 requests' span in thirds, the middle one 3× faster: 1/3 + 1/9 + 1/3 of it. (Cut
    // from the whole trace's span, all 300 fell in its first third and nothing changed.)
    assert!(span(&flat) > 10.0, "{}", span(&flat));
    assert!((span(&stepped) - span(&flat) * 7.0 / 9.0).abs() < 1e-6, "{} vs {}", span(&stepped), span(&flat));
    assert!(stepped["source"].as_str().unwrap().ends_with(", rate steps 1,3,1"), "{}", stepped["source"]);
}

#[test]
fn the_scale_csv_has_one_row_per_decision_in_time_order() {
    let csv = std::env::temp_dir().join(format!("kvmesh-scale-{}.csv", std::process::id()));
    let out = kvmesh(&[
        "replay",
        "--scenario",
        "bursts",
        "--requests",
        "400",
        "--rate",
        "20",
        "--replicas",
        "4",
        "--initial-replicas",
        "2",
        "--autoscale",
        "kvmesh",
        "--cold-start",
        "5",
        "--seeds",
        "2",
        "--scale-csv",
        csv.to_str().unwrap(),
        "--quiet",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let body = std::fs::read_to_string(&csv).unwrap();
    std::fs::remove_file(&csv).unwrap();
    let mut lines = body.lines();
    assert_eq!(
        lines.next(),
        Some("policy,seed,at_s,demand_tokens_per_s,forecast_tokens_per_s,capacity_tokens_per_s,desired,ready,starting,queued_tokens")
    );
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert!(rows.len() > 10 && rows.iter().all(|r| r.len() == 10 && r[0] == "token_load/kvmesh"), "{body}");
    // Seed 1's decisions, then seed 2's, each in time order (numeric, not as text).
    let seeds: Vec<&str> = rows.iter().map(|r| r[1]).collect();
    assert!(seeds.windows(2).all(|w| w[0] <= w[1]) && seeds[0] == "1" && seeds[seeds.len() - 1] == "2");
    for w in rows.windows(2).filter(|w| w[0][1] == w[1][1]) {
        assert!(w[0][2].parse::<f64>().unwrap() < w[1][2].parse::<f64>().unwrap(), "{:?} then {:?}", w[0], w[1]);
    }
    assert!(rows.iter().all(|r| r[2] == "0.0" || !r[2].starts_with('0')), "{body}");
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
        (
            &["--autoscale", "kvmesh", "--target-utilisation", "0"][..],
            "error: --target-utilisation must be in (0, 1], got 0\n",
        ),
        (&["--scale-csv", "x.csv"][..], "error: --scale-csv writes autoscaling decisions: give --autoscale too\n"),
        (
            &["--output-info", "soon"][..],
            "error: --output-info: unknown output info \"soon\"; known: max-tokens, learned, hint, oracle\n",
        ),
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
    assert!(text(&out.stdout).contains("\n random "), "{}", text(&out.stdout));
    assert!(text(&out.stderr).starts_with("error: writing the TTFT plot /nonexistent/dir/x.svg"));
}

#[test]
fn the_ttft_slo_flag_and_its_former_name_set_the_same_slo() {
    let base =
        ["replay", "--scenario", "hot-prompt", "--requests", "50", "--replicas", "2", "--policies", "token_load"];
    let run = |flag: &str| {
        let o = kvmesh(&[&base[..], &[flag, "0.25", "--autoscale", "kvmesh", "--quiet"]].concat());
        assert!(o.status.success(), "{}", text(&o.stderr));
        text(&o.stdout)
    };
    let (new, old) = (run("--ttft-slo"), run("--slo-ttft"));
    assert!(new.contains("autoscaling (SLO: TTFT ≤ 250 ms)"), "{new}");
    let strip = |s: &str| s.lines().filter(|l| !l.starts_with("simulated")).collect::<Vec<_>>().join("\n");
    assert_eq!(strip(&new), strip(&old));
}

#[test]
fn a_policy_param_changes_that_policy_only_and_bad_ones_are_refused() {
    let run = |extra: &[&str]| {
        let mut args = vec![
            "replay",
            "--scenario",
            "shared-90",
            "--requests",
            "300",
            "--replicas",
            "4",
            "--rate",
            "40",
            "--policies",
            "kv_cost,round_robin",
            "--json",
            "--quiet",
        ];
        args.extend_from_slice(extra);
        let out = kvmesh(&args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let mean = |i: usize| {
            let mut m = v["results"][i]["mean"].clone();
            m.as_object_mut().unwrap().remove("wall_s");
            m
        };
        (mean(0), mean(1))
    };
    let (kv, rr) = run(&[]);
    // Dynamo's cost without its overlap term spreads the shared prompt by load alone and loses
    // cache hits; round robin is untouched.
    let (kv_off, rr_off) = run(&["--policy-param", "kv_cost.overlap_weight=0"]);
    assert_eq!(rr, rr_off);
    let hit = |m: &serde_json::Value| m["hit_rate"].as_f64().unwrap();
    assert!(hit(&kv_off) < hit(&kv), "hit rate {} with overlap_weight 0, {} without", hit(&kv_off), hit(&kv));
    for (args, msg) in [
        ("x=1", "error: --policy-param \"x=1\": expected POLICY.NAME=VALUE, e.g. token_load.affinity_budget=0.6\n"),
        (
            "token_load.nope=1",
            "error: --policy-param for token_load: invalid policy_params: policy token_load has no parameter \"nope\"\n",
        ),
        (
            "token_load.affinity_budget=-1",
            "error: --policy-param for token_load: invalid policy_params: affinity_budget must be within 0..=10, got -1\n",
        ),
        ("kv_cost.overlap_weight=2", "error: --policy-param \"kv_cost.overlap_weight=2\" names kv_cost, which --policies does not run\n"),
    ] {
        let out = kvmesh(&["replay", "--scenario", "chat", "--quiet", "--policies", "token_load", "--policy-param", args]);
        assert_eq!((out.status.code(), text(&out.stderr)), (Some(1), msg.to_string()), "{args}");
    }
}

#[test]
fn the_outcomes_csv_has_one_row_per_request_and_agrees_with_the_table() {
    let dir = std::env::temp_dir().join(format!("kvmesh-outcomes-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("o.csv");
    let out = kvmesh(&[
        "replay",
        "--scenario",
        "shared-50",
        "--requests",
        "120",
        "--replicas",
        "2",
        "--policies",
        "token_load,random",
        "--seeds",
        "2",
        "--json",
        "--quiet",
        "--outcomes-csv",
        path.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let csv = std::fs::read_to_string(&path).unwrap();
    let mut lines = csv.lines();
    assert_eq!(
        lines.next(),
        Some(
            "policy,seed,arrival_s,replica,prompt_tokens,cached_tokens,output_tokens,ttft_s,estimated_ttft_s,e2e_s,\
             rejected,no_queue_ttft_s,floor_ttft_s"
        )
    );
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), 2 * 2 * 120);
    // Sorted by policy, then seed, trace order within a run.
    assert_eq!((rows[0][0], rows[0][1]), ("random", "1"));
    assert_eq!((rows[120][0], rows[120][1]), ("random", "2"));
    assert_eq!((rows[479][0], rows[479][1]), ("token_load", "2"));
    for (k, policy) in ["token_load", "random"].iter().enumerate() {
        let seed1: Vec<&Vec<&str>> = rows.iter().filter(|r| r[0] == *policy && r[1] == "1").collect();
        let num = |r: &Vec<&str>, c: usize| r[c].parse::<f64>().unwrap();
        let (cached, prompt) = seed1.iter().fold((0.0, 0.0), |(c, p), r| (c + num(r, 5), p + num(r, 4)));
        let hit = v["results"][k]["per_seed"][0]["hit_rate"].as_f64().unwrap();
        assert!((cached / prompt - hit).abs() < 1e-9, "{policy}: {} against {hit}", cached / prompt);
        assert!(seed1.iter().all(|r| r[3].parse::<u32>().unwrap() < 2 && num(r, 7) > 0.0 && num(r, 9) >= num(r, 7)));
        let max_ttft = seed1.iter().map(|r| num(r, 7)).fold(0.0, f64::max);
        let p99 = v["results"][k]["per_seed"][0]["ttft_p99"].as_f64().unwrap();
        assert!(p99 <= max_ttft + 1e-6, "{policy}: p99 {p99} above the CSV's largest TTFT {max_ttft}");
        // Every TTFT is at least its request's prefill alone, which is at least its floor; the
        // no-queue p99 is the p99 of the former (nearest rank over the 120 served).
        assert!(seed1.iter().all(|r| num(r, 7) >= num(r, 11) - 1e-6 && num(r, 11) >= num(r, 12) - 1e-6));
        let mut own: Vec<f64> = seed1.iter().map(|r| num(r, 11)).collect();
        own.sort_by(f64::total_cmp);
        let no_queue = v["results"][k]["per_seed"][0]["ttft_p99_no_queue"].as_f64().unwrap();
        assert!((own[118] - no_queue).abs() < 1e-5, "{policy}: {} against {no_queue}", own[118]);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn rl_rollouts_get_a_decode_table_with_their_steps() {
    let args = |info: &'static str| {
        [
            "replay",
            "--scenario",
            "rl",
            "--requests",
            "512",
            "--rate",
            "64",
            "--replicas",
            "2",
            "--policies",
            "token_load",
            "--output-info",
            info,
            "--json",
            "--quiet",
        ]
    };
    for info in ["max-tokens", "learned", "hint", "oracle"] {
        let out = kvmesh(&args(info));
        assert!(out.status.success(), "{}", text(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["output_info"], info);
        let m = &v["results"][0]["mean"];
        // 512 rollouts are 4 steps of 128; every one completes.
        assert_eq!((m["completed"].as_u64(), m["steps"].as_u64()), (Some(512), Some(4)), "{info}");
        // No run beats its floors: every request alone, in a batch of one.
        let floor = |k: &str| v["floors"][k].as_f64().unwrap();
        assert!(floor("e2e_p99_all_cached") > 1.0 && floor("e2e_p99_all_cached") <= m["e2e_p99"].as_f64().unwrap());
        assert!(floor("step_p99_all_cached") >= floor("e2e_p99_all_cached"), "a step waits for its slowest rollout");
        assert!(floor("step_p99_all_cached") <= m["step_p99"].as_f64().unwrap(), "{info}");
        assert!(floor("output_tps_ceiling") >= m["output_tps"].as_f64().unwrap(), "{info}");
    }
    let mut plain = args("learned")[..13].to_vec();
    plain.push("--quiet");
    let table = text(&kvmesh(&plain).stdout);
    let decode = table.split("decode and steps (output lengths known to the router: learned)\n").nth(1).unwrap();
    let (floor, rows) = decode.split_once('\n').unwrap();
    assert!(
        floor.starts_with(
            "floor (every request of the trace alone, decoding in a batch of one, every reusable prefix cached): E2E p99 "
        ) && floor.contains(", step p99 ")
            && floor.contains("; out tok/s at most "),
        "{table}"
    );
    assert!(
        rows.starts_with(
            " policy      E2E p50  E2E p99  steps  step p50  step p99  out tok/s  preemptions\n token_load"
        ),
        "{table}"
    );
}

#[test]
fn a_request_never_served_has_its_prompt_and_floor_but_no_ttft_in_the_outcomes_csv() {
    let dir = std::env::temp_dir().join(format!("kvmesh-rejected-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // A Mooncake trace whose second prompt (600,000 tokens) is larger than an H100 replica's
    // KV cache (470,000 tokens): the engine cannot serve it.
    let line = |at: u32, tokens: u32, ids: std::ops::Range<u32>| {
        format!(
            "{{\"timestamp\": {at}, \"input_length\": {tokens}, \"output_length\": 5, \"hash_ids\": {:?}}}\n",
            ids.collect::<Vec<_>>()
        )
    };
    let trace = dir.join("t.jsonl");
    std::fs::write(&trace, line(0, 1000, 1..3) + &line(100, 600_000, 10..1182) + &line(200, 1000, 1..3)).unwrap();
    let csv = dir.join("o.csv");
    let out = kvmesh(&[
        "replay",
        "--trace",
        trace.to_str().unwrap(),
        "--replicas",
        "1",
        "--policies",
        "token_load",
        "--quiet",
        "--outcomes-csv",
        csv.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows: Vec<Vec<String>> = std::fs::read_to_string(&csv)
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| l.split(',').map(str::to_string).collect())
        .collect();
    // Served, on the H100 step model: 1,000 tokens alone take 23 ms (17.25 µs a token and one
    // 5.75 ms step); the third reuses the first's 992 cached tokens (62 whole blocks).
    assert_eq!(rows[0][7..].to_vec(), ["0.023000", "0.023000", "0.046024", "false", "0.023000", "0.023000"]);
    assert_eq!(rows[2][5], "992");
    assert_eq!(rows[2][11], rows[2][7], "served at once: TTFT is its own prefill");
    // Never served: its prompt and floor are there, its TTFT, E2E and no-queue time empty.
    assert_eq!(rows[1][4], "600000");
    assert_eq!((rows[1][7].as_str(), rows[1][9].as_str(), rows[1][10].as_str()), ("", "", "true"));
    assert_eq!((rows[1][11].as_str(), rows[1][12].as_str()), ("", "10.775500"));
    std::fs::remove_dir_all(&dir).unwrap();
}
