//! Durations as text, the old keys' hints, the warnings, and what each refusal names.

use super::super::*;
use super::EXAMPLE;

#[test]
fn durations_are_written_as_text_and_core_settings_are_keys_of_their_section() {
    let c: NodeConfig = toml::from_str(&format!(
        "{EXAMPLE}\n[autoscaler]\ninterval = \"500ms\"\ncold_start = \"1m 30s\"\npanic_window = \"10s\"\n\
         capacity_tokens_per_s = 5000\n[replication]\ncooldown = \"45s\"\nreport_top = 4\n\
         sketch = {{ capacity = 100, half_life = \"5s\" }}\n[cluster]\nid = 1\nheartbeat = \"50ms\"\n"
    ))
    .unwrap();
    // Each key reaches the core's own setting, in seconds.
    assert_eq!((c.autoscaler.policy.interval_s, c.autoscaler.policy.cold_start_s), (0.5, 90.0));
    assert_eq!((c.autoscaler.policy.panic_window_s, c.autoscaler.capacity_tokens_per_s), (10.0, 5000.0));
    assert_eq!((c.replication.plan.cooldown_s, c.replication.report_top), (45.0, 4));
    assert_eq!((c.replication.plan.sketch.capacity, c.replication.plan.sketch.half_life_s), (100, 5.0));
    assert_eq!(c.cluster.as_ref().unwrap().heartbeat, std::time::Duration::from_millis(50));
    // Written back as text, and read back the same.
    let text = c.to_toml();
    assert!(text.contains("interval = \"500ms\"") && text.contains("cold_start = \"1m 30s\""), "{text}");
    assert!(text.contains("scrape_interval = \"1s\""), "{text}");
    assert_eq!(toml::from_str::<NodeConfig>(&text).unwrap(), c);
    // A core setting's range is checked and named by its key.
    let bad: NodeConfig = toml::from_str("[replication]\ncooldown = \"0s\"").unwrap();
    assert_eq!(bad.validate().unwrap_err().to_string(), "replication.cooldown must be positive seconds, got 0");
}

#[test]
fn a_key_of_no_part_of_a_section_is_refused_with_both_parts_keys() {
    let e = NodeConfig::parse("[autoscaler]\nenabled = true\ncold_strat = \"30s\"\n").unwrap_err().to_string();
    assert!(e.contains("unknown field `cold_strat`, expected one of `enabled`, `pool`"), "{e}");
    assert!(e.contains("hint: did you mean `cold_start`?"), "{e}");
    // The reactive baseline's thresholds are not node settings.
    assert!(NodeConfig::parse("[autoscaler]\nreactive_high = 0.9\n")
        .unwrap_err()
        .to_string()
        .contains("unknown field"));
    let e = NodeConfig::parse("[replication]\ninterval = \"soon\"\n").unwrap_err().to_string();
    assert!(e.contains("\"soon\" is not a duration"), "{e}");
}

#[test]
fn a_duration_key_from_before_the_rename_gets_its_new_form() {
    // One run names every old key of the file, not only the first serde met.
    let old = "[node]\nscrape_interval_ms = 500\nrequest_timeout_s = 300\n[cluster]\nid = 1\nheartbeat_ms = 100\n\
               [autoscaler]\ncold_start_s = 90\n[replication]\nhalf_life_s = 5\n";
    let e = NodeConfig::parse(old).unwrap_err().to_string();
    assert!(
        e.ends_with(
            "hint: every duration key from before in this file, as it is now: [node] request_timeout = \"5m\"; \
             [node] scrape_interval = \"500ms\"; [cluster] heartbeat = \"100ms\"; [autoscaler] cold_start = \"1m 30s\"; \
             [replication] sketch = { half_life = \"5s\" }"
        ),
        "{e}"
    );
    let e = NodeConfig::parse("[node]\nscrape_interval_ms = 250\n").unwrap_err().to_string();
    assert!(
        e.contains("hint: durations are text now: write scrape_interval = \"250ms\" (units: ms, s, m, h, days)"),
        "{e}"
    );
    let e = NodeConfig::parse("[autoscaler]\ncold_start_s = 90\n").unwrap_err().to_string();
    assert!(e.contains("write cold_start = \"1m 30s\""), "{e}");
    let e = NodeConfig::parse("[node]\nbooking_lease_s = 0.5\n").unwrap_err().to_string();
    assert!(e.contains("write booking_lease = \"500ms\""), "{e}");
    let e = NodeConfig::parse("[replication]\nhalf_life_s = 5\nsketch_capacity = 1000\n").unwrap_err().to_string();
    assert!(
        e.ends_with(
            "hint: [replication]'s sketch settings are a table now: sketch = { half_life = \"5s\", capacity = 1000 }"
        ),
        "{e}"
    );
    // Text that is not a duration: the grammar.
    let e = NodeConfig::parse("[node]\nscrape_interval = \"2 sek\"\n").unwrap_err().to_string();
    assert!(e.ends_with("(units: us, ms, s, m, h, days; lower case)"), "{e}");
    let e = NodeConfig::parse("[autoscaler]\ncold_start = \"2 sek\"\n").unwrap_err().to_string();
    assert!(e.ends_with("(units: us, ms, s, m, h, days; lower case)"), "{e}");
    // A number where text is wanted says so too.
    let e = NodeConfig::parse("[node]\nscrape_interval = 250\n").unwrap_err().to_string();
    assert!(e.contains("hint: durations are text with a unit: scrape_interval = \"250ms\" or \"250s\""), "{e}");
    // Also in a section read in parts, whose error points at the table: the key is named.
    let e = NodeConfig::parse("[replication]\nenabled = true\ninterval = 5\n").unwrap_err().to_string();
    assert!(e.contains("`interval`: invalid type: integer `5`"), "{e}");
    assert!(e.contains("hint: durations are text with a unit: interval = \"5s\" or \"5ms\""), "{e}");
    // The same key in another section before it is not the one quoted.
    let e =
        NodeConfig::parse("[autoscaler]\ninterval = \"2s\"\n[replication]\ninterval = 7\n").unwrap_err().to_string();
    assert!(e.contains("interval = \"7s\" or \"7ms\""), "{e}");
}

#[test]
fn doubts_name_a_lease_shorter_than_the_timeout_and_an_slo_the_queue_ignores() {
    let with = |extra: &str| toml::from_str::<NodeConfig>(&format!("{EXAMPLE}\n{extra}\n")).unwrap().doubts();
    assert_eq!(
        with("[admission]\nttft_slo = \"2s\""),
        ["admission.ttft_slo is set but admission.enabled is false: the TTFT gate is off"]
    );
    assert_eq!(
        with("[admission]\nenabled = true\nttft_slo = \"2s\"\nmax_wait = \"21s\""),
        ["admission.max_wait (\"21s\") is over 10x admission.ttft_slo (\"2s\"): late requests wait behind fresh ones \
          and may wait up to max_wait; a few times the SLO (say 3x) bounds how late an answer can come"]
    );
    assert!(with("[admission]\nenabled = true\nttft_slo = \"2s\"\nmax_wait = \"20s\"").is_empty());
    let text = EXAMPLE.replacen("[node]\n", "[node]\nbooking_lease = \"5m\"\n", 1);
    assert_eq!(
        toml::from_str::<NodeConfig>(&text).unwrap().doubts(),
        ["node.booking_lease (\"5m\") is shorter than node.request_timeout (\"10m\"): a proxied request that runs \
          longer than the lease stops counting in its replica's token load while it runs"]
    );
}

#[test]
fn durations_zero_where_it_means_something_and_bounded_elsewhere() {
    let with = |extra: &str| toml::from_str::<NodeConfig>(&format!("{EXAMPLE}\n{extra}\n")).unwrap().validate();
    // 0: no backoff after a 429/503, and an owed event overdue at once.
    let text = EXAMPLE.replacen("[node]\n", "[node]\noverload_backoff = \"0s\"\nevents_silent = \"0s\"\n", 1);
    toml::from_str::<NodeConfig>(&text).unwrap().validate().unwrap();
    let text = EXAMPLE.replacen("[node]\n", "[node]\nrequest_timeout = \"0s\"\n", 1);
    assert_eq!(
        toml::from_str::<NodeConfig>(&text).unwrap().validate().unwrap_err().to_string(),
        "node.request_timeout must be positive and at most a day (\"24h\"), got \"0s\""
    );
    // A loop's period past a day is refused (the gossip task counts back from now by it).
    assert_eq!(
        with("[replication]\ninterval = \"2days\"").unwrap_err().to_string(),
        "replication.interval must be positive and at most a day (\"24h\"), got \"2days\""
    );
    assert!(with("[autoscaler]\ninterval = \"25h\"").is_err());
    // Raft's timings are whole milliseconds: 1.2 ms and 1.9 ms are both 1 ms there.
    let raft = |t: &str| with(&format!("[cluster]\nid = 1\n{t}"));
    assert_eq!(
        raft("heartbeat = \"500us\"\nelection_timeout_min = \"1ms 200us\"\nelection_timeout_max = \"1ms 900us\"")
            .unwrap_err()
            .to_string(),
        "cluster: need heartbeat < election_timeout_min < election_timeout_max, in whole milliseconds; got 0 < 1 < \
         1 ms"
    );
    raft("heartbeat = \"50ms\"\nelection_timeout_min = \"150ms\"\nelection_timeout_max = \"300ms\"").unwrap();
    // The sketch counts prefixes of at least 4 blocks: a shallower cap would count none.
    assert_eq!(
        with("[replication]\nsketch = { max_depth_blocks = 3 }").unwrap_err().to_string(),
        "replication.sketch.max_depth_blocks must be at least 4, got 3"
    );
}

#[test]
fn doubts_name_two_replicas_on_one_kv_event_publisher() {
    let mut c: NodeConfig = toml::from_str(EXAMPLE).unwrap();
    let mut second = c.replicas[0].clone();
    second.name = "vllm-1".into();
    second.http = "http://10.0.0.8:8000".into();
    c.replicas.push(second);
    assert_eq!(
        c.doubts(),
        ["replicas \"vllm-0\" and \"vllm-1\" subscribe to the same KV-event publisher tcp://10.0.0.7:5557: each would \
          be indexed with the other's blocks (each engine, and each data-parallel rank, publishes on its own port)"]
    );
    c.replicas[1].kv_events = Some("tcp://10.0.0.8:5557".into());
    assert!(c.doubts().is_empty());
}

#[test]
fn a_refusal_names_what_is_at_fault_in_its_variant() {
    let with =
        |find: &str, put: &str| toml::from_str::<NodeConfig>(&EXAMPLE.replacen(find, put, 1)).unwrap().validate();
    assert_eq!(
        with("[node]\n", "[node]\nblock_size = 0\n").unwrap_err(),
        ConfigError::Setting { key: "node.block_size".into(), problem: "must be positive".into() }
    );
    assert_eq!(
        with("capacity_blocks = 100", "capacity_blocks = 0\nengine = \"sglang\"").unwrap_err(),
        ConfigError::Replica {
            replica: "vllm-0".into(),
            problem: "capacity_blocks is required for an sglang engine (its metrics do not report its KV capacity): \
                      set it to the engine's max_total_num_tokens / block size"
                .into()
        }
    );
    // A core config's own refusal keeps the key of the section it sits in.
    let bad: NodeConfig = toml::from_str("[autoscaler]\ntarget_utilisation = 2").unwrap();
    assert!(matches!(bad.validate(), Err(ConfigError::Setting { key, .. }) if key == "autoscaler.target_utilisation"));
    let clustered = format!("{EXAMPLE}\n[cluster]\nid = 1\nheartbeat = \"1s\"\n");
    assert!(matches!(toml::from_str::<NodeConfig>(&clustered).unwrap().validate(), Err(ConfigError::Conflict(_))));
    // Not TOML for this schema: toml's message and the hint apart.
    match NodeConfig::parse("[node]\nscrape_interval_ms = 250\n").unwrap_err() {
        ConfigError::Syntax { message, hint } => {
            assert!(message.contains("unknown field `scrape_interval_ms`"), "{message}");
            assert_eq!(
                hint,
                "\nhint: durations are text now: write scrape_interval = \"250ms\" (units: ms, s, m, h, days)"
            );
        }
        other => panic!("not a syntax error: {other:?}"),
    }
}
