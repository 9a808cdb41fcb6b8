//! The configuration's unit tests: loading, validation and every refusal's message.

use super::*;

const EXAMPLE: &str = r#"
[node]
http = "127.0.0.1:8080"
policy = "kv_cost"

[[replicas]]
name = "vllm-0"
http = "http://10.0.0.7:8000"
kv_events = "tcp://10.0.0.7:5557"
capacity_blocks = 100
"#;

#[test]
fn doubts_name_a_node_with_no_replicas_and_a_cap_below_the_fleet() {
    let mut c: NodeConfig = toml::from_str(EXAMPLE).unwrap();
    assert_eq!(c.doubts(), Vec::<String>::new());
    c.autoscaler.enabled = true;
    c.autoscaler.policy.max_replicas = 1;
    let mut second = c.replicas[0].clone();
    second.name = "vllm-1".into();
    second.http = "http://10.0.0.8:8000".into();
    second.kv_events = Some("tcp://10.0.0.8:5557".into());
    c.replicas.push(second);
    assert_eq!(c.validate(), Ok(()));
    assert_eq!(
        c.doubts(),
        ["autoscaler.max_replicas (1) is below the 2 replicas configured: no decision asks for more than 1"]
    );
    c.node.policy = "weighted_scorer".into();
    assert_eq!(
        c.doubts()[0],
        "policy weighted_scorer reproduces a router that reads engine metrics every 50ms; node.scrape_interval is 1s, \
         so it scores on older gauges than that router would (set node.scrape_interval = \"50ms\" to match)"
    );
    c.node.scrape_interval = std::time::Duration::from_millis(50);
    assert_eq!(c.doubts().len(), 1, "only the autoscaler's doubt is left");
    let empty: NodeConfig = toml::from_str("").unwrap();
    assert_eq!(empty.doubts().len(), 1);
    assert!(empty.doubts()[0].starts_with("no [[replicas]] configured: the node routes nothing"));
    // A cluster node gets its replicas from the registry.
    let joining: NodeConfig = toml::from_str("[cluster]\nid = 2\n").unwrap();
    assert_eq!(joining.doubts(), Vec::<String>::new());
}

#[test]
fn parses_with_defaults_and_validates() {
    let c: NodeConfig = toml::from_str(EXAMPLE).unwrap();
    assert_eq!((c.node.policy.as_str(), c.node.block_size, c.node.grpc.port()), ("kv_cost", 16, 50051));
    assert_eq!(c.replicas[0].metrics(), "http://10.0.0.7:8000/metrics");
    assert_eq!((c.replicas[0].replay.as_deref(), c.replicas[0].engine.as_str()), (None, "vllm"));
    c.validate().unwrap();
    let back: NodeConfig = toml::from_str(&c.to_toml()).unwrap();
    assert_eq!(back, c);
}

#[test]
fn autoscaler_settings_are_checked_in_the_same_words() {
    let with = |extra: &str| toml::from_str::<NodeConfig>(&format!("{EXAMPLE}\n[autoscaler]\n{extra}\n")).unwrap();
    assert_eq!(
        with("target_utilisation = 2").validate().unwrap_err().to_string(),
        "autoscaler.target_utilisation must be in (0, 1], got 2"
    );
    assert_eq!(
        with("min_replicas = 3\nmax_replicas = 2").validate().unwrap_err().to_string(),
        "autoscaler.max_replicas must be positive and at least min_replicas (3), got 2"
    );
}

#[test]
fn admission_settings_are_checked() {
    let with = |extra: &str| toml::from_str::<NodeConfig>(&format!("{EXAMPLE}\n[admission]\n{extra}\n")).unwrap();
    let c = with("enabled = true\nttft_slo = \"2s 500ms\"");
    assert_eq!(c.admission.ttft_slo, Some(std::time::Duration::from_millis(2500)));
    c.validate().unwrap();
    assert_eq!(
        with("ttft_slo = \"0s\"").validate().unwrap_err().to_string(),
        "admission.ttft_slo must be positive and at most a day (\"24h\"), got \"0s\""
    );
    assert_eq!(
        with("max_wait = \"25h\"").validate().unwrap_err().to_string(),
        "admission.max_wait must be positive and at most a day (\"24h\"), got \"1day 1h\""
    );
    assert_eq!(
        with("queue_limit = 0").validate().unwrap_err().to_string(),
        "admission.queue_limit must be 1 to 1000000 requests, got 0"
    );
    with("queue_limit = 1000000").validate().unwrap();
    let lease = |v: &str| {
        let text = EXAMPLE.replacen("[node]\n", &format!("[node]\nbooking_lease = {v:?}\n"), 1);
        toml::from_str::<NodeConfig>(&text).unwrap().validate()
    };
    assert_eq!(
        lease("0s").unwrap_err().to_string(),
        "node.booking_lease must be positive and at most a day (\"24h\"), got \"0s\""
    );
    lease("30s").unwrap();
    assert_eq!(toml::from_str::<NodeConfig>(EXAMPLE).unwrap().admission.ttft_slo, None);
}

#[test]
fn a_data_parallel_size_becomes_one_replica_per_rank_at_the_offset_ports() {
    let entry = |extra: &str| {
        let text = format!(
            "name = \"v\"\nhttp = \"http://10.0.0.7:8000\"\nkv_events = \"tcp://10.0.0.7:5557\"\n\
             replay = \"tcp://10.0.0.7:5600\"\ncapacity_blocks = 100\n{extra}"
        );
        toml::from_str::<ReplicaConfig>(&text).unwrap()
    };
    let ranks = entry("data_parallel_size = 3").ranks().unwrap();
    type Rank = (String, Option<u32>, Option<String>, Option<String>, u64);
    let got: Vec<Rank> = ranks
        .iter()
        .map(|r| (r.name.clone(), r.data_parallel_rank, r.kv_events.clone(), r.replay.clone(), r.capacity_blocks))
        .collect();
    let want = |k: u32| {
        (
            format!("v-dp{k}"),
            Some(k),
            Some(format!("tcp://10.0.0.7:{}", 5557 + k)),
            Some(format!("tcp://10.0.0.7:{}", 5600 + k)),
            100,
        )
    };
    assert_eq!(got, [want(0), want(1), want(2)]);
    assert!(ranks.iter().all(|r| r.http == "http://10.0.0.7:8000" && r.data_parallel_size.is_none()));
    assert!(ranks.iter().all(|r| r.validate().is_ok()));
    // Without a size the entry stands for itself; a size of 1 is one rank.
    assert_eq!(entry("").ranks().unwrap(), [entry("")]);
    assert_eq!(entry("data_parallel_size = 1").ranks().unwrap()[0].name, "v-dp0");
    for (extra, err) in [
        ("data_parallel_size = 0", "replica \"v\": data_parallel_size must be 1..=1024, got 0"),
        ("data_parallel_size = 1025", "replica \"v\": data_parallel_size must be 1..=1024, got 1025"),
        (
            "data_parallel_size = 2\ndata_parallel_rank = 1",
            "replica \"v\": data_parallel_size and data_parallel_rank exclude each other (the size writes the ranks)",
        ),
    ] {
        assert_eq!(entry(extra).ranks().unwrap_err().to_string(), err);
    }
    let close = ReplicaConfig { replay: Some("tcp://10.0.0.7:5558".into()), ..entry("data_parallel_size = 2") };
    assert_eq!(
        close.ranks().unwrap_err().to_string(),
        "replica \"v\": with data_parallel_size 2, tcp://10.0.0.7:5558 is both a publisher and a replay socket \
         (vLLM adds the rank to both ports): keep kv_events and replay at least 2 ports apart"
    );
    let high = ReplicaConfig { kv_events: Some("tcp://h:65535".into()), ..entry("data_parallel_size = 2") };
    assert_eq!(
        high.ranks().unwrap_err().to_string(),
        "replica \"v\": kv_events \"tcp://h:65535\": port 65535 + rank 1 is past 65535"
    );
    // An entry that still has a size was not read through NodeConfig::read.
    assert!(entry("data_parallel_size = 2")
        .validate()
        .unwrap_err()
        .to_string()
        .contains("data_parallel_size is expanded"));
}

#[test]
fn replica_models_other_than_the_default_are_said_and_never_an_adapters_name() {
    let mut c: NodeConfig = toml::from_str(EXAMPLE).unwrap();
    c.node.model = "m1".into();
    c.replicas[0].model = Some("m2".into());
    assert_eq!(
        c.doubts(),
        ["replicas declare models other than node.model (\"m1\"): [\"m2\"]; each serves only requests naming its \
          model (a request naming none goes to node.model's replicas)"]
    );
    c.node.lora_adapters = vec!["m2".into()];
    assert_eq!(
        c.validate().unwrap_err().to_string(),
        "replica \"vllm-0\": model \"m2\" is also one of node.lora_adapters; a request naming it would get the adapter"
    );
}

#[test]
fn a_disaggregated_model_needs_both_sides_and_one_engine() {
    let mut c: NodeConfig = toml::from_str(EXAMPLE).unwrap();
    c.node.model = "m".into();
    c.replicas[0].role = Role::Prefill;
    assert_eq!(
        c.doubts(),
        ["model \"m\" has prefill replicas but no decode replica: its requests go to its `both` replicas only, and \
          the prefill replicas serve nothing until a decode replica is added"]
    );
    let mut decode = c.replicas[0].clone();
    decode.name = "vllm-1".into();
    decode.http = "http://10.0.0.8:8000".into();
    decode.kv_events = Some("tcp://10.0.0.8:5557".into());
    decode.role = Role::Decode;
    decode.engine = "sglang".into();
    c.replicas.push(decode);
    assert_eq!(c.doubts(), Vec::<String>::new());
    assert_eq!(
        c.validate().unwrap_err().to_string(),
        "model \"m\": replica \"vllm-1\" has engine \"sglang\" but replica \"vllm-0\" has \"vllm\"; a disaggregated \
         model's prefill and decode replicas must run one engine (it decides the hand-over)"
    );
    c.replicas[1].engine = "vllm".into();
    assert_eq!(c.validate(), Ok(()));
    // Informational for a replica serving whole requests, as it always was.
    c.replicas[0].role = Role::Both;
    c.replicas[0].engine = "trtllm".into();
    assert_eq!(c.replicas[0].validate(), Ok(()));
    c.replicas[0].role = Role::Prefill;
    assert_eq!(
        c.replicas[0].validate().unwrap_err().to_string(),
        "replica \"vllm-0\": engine must be vllm or sglang for a prefill replica (it decides the hand-over), got \"trtllm\""
    );
}

#[test]
fn lora_adapters_are_named_once_and_not_the_base_model() {
    let with = |v: &str| {
        let text = EXAMPLE.replacen("[node]\n", &format!("[node]\nmodel = \"m\"\nlora_adapters = {v}\n"), 1);
        toml::from_str::<NodeConfig>(&text).unwrap().validate()
    };
    with("[\"sql\", \"chat\"]").unwrap();
    assert_eq!(with("[\"sql\", \"sql\"]").unwrap_err().to_string(), "node.lora_adapters has \"sql\" twice");
    assert_eq!(
        with("[\"m\"]").unwrap_err().to_string(),
        "node.lora_adapters has \"m\": empty or the base model's name"
    );
    assert_eq!(with("[\"\"]").unwrap_err().to_string(), "node.lora_adapters has \"\": empty or the base model's name");
    // A replica's own list: the same rules.
    let mut c: NodeConfig = toml::from_str(EXAMPLE).unwrap();
    c.replicas[0].model = Some("m2".into());
    c.replicas[0].lora_adapters = Some(vec!["sql".into(), "sql".into()]);
    assert_eq!(c.validate().unwrap_err().to_string(), "replica \"vllm-0\": lora_adapters: \"sql\" appears twice");
    c.replicas[0].lora_adapters = Some(vec!["m2".into()]);
    assert_eq!(
        c.validate().unwrap_err().to_string(),
        "replica \"vllm-0\": lora_adapters: \"m2\" is empty or the replica's model"
    );
    c.replicas[0].lora_adapters = Some(vec!["sql".into()]);
    c.validate().unwrap();
    // Never another model's name: a request naming it would mean the model.
    c.node.model = "m1".into();
    c.replicas[0].lora_adapters = Some(vec!["m1".into()]);
    assert_eq!(
        c.validate().unwrap_err().to_string(),
        "replica \"vllm-0\": lora_adapters: \"m1\" is a model's name (or node.model's adapter) here"
    );
}

#[test]
fn errors_name_the_field() {
    let bad = EXAMPLE.replace("kv_cost", "fastest");
    let c: NodeConfig = toml::from_str(&bad).unwrap();
    assert!(
        c.validate()
            .unwrap_err()
            .to_string()
            .starts_with("node.policy names no policy (\"fastest\"); known policies: "),
        "{:?}",
        c.validate()
    );
    let bad = EXAMPLE.replace("tcp://10.0.0.7:5557", "10.0.0.7:5557");
    let c: NodeConfig = toml::from_str(&bad).unwrap();
    assert_eq!(
        c.validate().unwrap_err().to_string(),
        "replica \"vllm-0\": kv_events \"10.0.0.7:5557\": only tcp://host:port endpoints are supported"
    );
    // No port: refused here, not retried as a parse error at every restart of the actor.
    let c: NodeConfig = toml::from_str(&EXAMPLE.replace("tcp://10.0.0.7:5557", "tcp://10.0.0.7")).unwrap();
    assert_eq!(
        c.validate().unwrap_err().to_string(),
        "replica \"vllm-0\": kv_events \"tcp://10.0.0.7\" has no port (tcp://host:port)"
    );
    let c: NodeConfig = toml::from_str(&EXAMPLE.replace(
        "kv_events = \"tcp://10.0.0.7:5557\"",
        "kv_events = \"tcp://10.0.0.7:5557\"\nreplay = \"ipc:///tmp/replay\"",
    ))
    .unwrap();
    assert_eq!(
        c.validate().unwrap_err().to_string(),
        "replica \"vllm-0\": replay \"ipc:///tmp/replay\": only tcp://host:port endpoints are supported"
    );
    // https engines: refused up front (the engine client has no TLS backend).
    let c: NodeConfig = toml::from_str(&EXAMPLE.replace("http://10.0.0.7:8000", "https://10.0.0.7:8000")).unwrap();
    assert!(c
        .validate()
        .unwrap_err()
        .to_string()
        .starts_with("replica \"vllm-0\": http \"https://10.0.0.7:8000\": https:// engines are not supported"));
    let clustered = format!("{EXAMPLE}\n[cluster]\nid = 2\npeers = [\"1=a:1\", \"3=c:3\"]\n");
    let c: NodeConfig = toml::from_str(&clustered).unwrap();
    assert_eq!(c.validate().unwrap_err().to_string(), "cluster.peers must include this node (id 2)");
    let c: NodeConfig = toml::from_str(&clustered.replace("3=c:3", "2=b")).unwrap();
    assert_eq!(c.validate().unwrap_err().to_string(), "cluster.peers entry \"2=b\" is not id=host:port with id > 0");
    let c: NodeConfig = toml::from_str(&clustered.replace("3=c:3", "2=b:2")).unwrap();
    c.validate().unwrap();
    assert_eq!(c.cluster.unwrap().peer_map().unwrap().get(&2).map(String::as_str), Some("b:2"));
    let c: NodeConfig =
        toml::from_str(&EXAMPLE.replace("capacity_blocks = 100", "capacity_blocks = 100\nblock_size = 32")).unwrap();
    assert_eq!(
        c.validate().unwrap_err().to_string(),
        "replica \"vllm-0\": block_size 32 differs from node.block_size 16 (a replica of node.model has its block \
         size; another model may have its own)"
    );
    // Another model may have its own, one per model.
    let mut c: NodeConfig = toml::from_str(EXAMPLE).unwrap();
    let mut other = c.replicas[0].clone();
    other.name = "qwen-0".into();
    other.http = "http://10.0.0.8:8000".into();
    other.model = Some("qwen".into());
    other.block_size = Some(32);
    c.replicas.push(other.clone());
    c.validate().unwrap();
    other.name = "qwen-1".into();
    other.http = "http://10.0.0.9:8000".into();
    other.block_size = None;
    c.replicas.push(other);
    assert_eq!(
        c.validate().unwrap_err().to_string(),
        "replica \"qwen-1\": block_size 16 differs from replica \"qwen-0\"'s 32: the replicas of model \"qwen\" must \
         share one block size"
    );
    let c: NodeConfig = toml::from_str(
        &EXAMPLE.replace("policy = \"kv_cost\"", "policy = \"kv_cost\"\npolicy_params = { weight = 1.0 }"),
    )
    .unwrap();
    assert_eq!(
        c.validate().unwrap_err().to_string(),
        "node.policy_params has a bad entry: policy kv_cost has no parameter \"weight\""
    );
    let c: NodeConfig =
        toml::from_str(&EXAMPLE.replace("policy = \"kv_cost\"", "policy = \"kv_cost\"\nproxy_threads = 0")).unwrap();
    assert_eq!(c.validate().unwrap_err().to_string(), "node.proxy_threads must be at least 1");
    let typo = EXAMPLE.replace("capacity_blocks", "capacity");
    assert!(toml::from_str::<NodeConfig>(&typo).unwrap_err().to_string().contains("unknown field `capacity`"));
}

#[test]
fn a_nodes_own_entry_in_peers_must_be_where_it_serves() {
    let section = |addr: &str, own: &str| ClusterSection {
        id: 2,
        addr: addr.into(),
        peers: vec!["1=10.0.0.1:50051".into(), format!("2={own}")],
        ..ClusterSection::default()
    };
    assert_eq!(section("", "10.0.0.2:50051").check_own_peer(50051), Ok(()));
    assert_eq!(section("10.0.0.2:50051", "10.0.0.2:50051").check_own_peer(40000), Ok(()));
    assert_eq!(
        section("", "10.0.0.2:50099").check_own_peer(50051).unwrap_err().to_string(),
        "cluster.peers lists this node (id 2) at 10.0.0.2:50099, but it serves gRPC on port 50051: peers would dial \
         the wrong address; fix its entry in peers (or cluster.addr)"
    );
    assert!(section("10.0.0.2:50051", "10.0.0.9:50051").check_own_peer(50051).is_err());
    // A node that joins later lists no peers.
    assert_eq!(ClusterSection { id: 4, ..ClusterSection::default() }.check_own_peer(1), Ok(()));
}

#[test]
fn a_reload_names_the_sections_it_does_not_apply() {
    let running: NodeConfig = toml::from_str("[node]\npolicy = \"token_load\"").unwrap();
    let mut file = running.clone();
    file.replicas.push(toml::from_str("name = \"e0\"\nhttp = \"http://127.0.0.1:9\"\ncapacity_blocks = 10").unwrap());
    assert_eq!(sections_changed(&running, &file), Vec::<&str>::new(), "replicas are what a reload applies");
    file.node.policy = "round_robin".into();
    file.autoscaler.enabled = true;
    assert_eq!(sections_changed(&running, &file), vec!["[node]", "[autoscaler]"]);
}

#[test]
fn one_engine_under_two_names_is_refused() {
    let two = |second: &str| {
        let text = format!(
            "[[replicas]]\nname = \"a\"\nhttp = \"http://10.0.0.7:8000\"\ncapacity_blocks = 10\n\
             [[replicas]]\nname = \"b\"\nhttp = \"{second}\"\ncapacity_blocks = 10\n"
        );
        toml::from_str::<NodeConfig>(&text).unwrap().validate()
    };
    assert_eq!(
        two("http://10.0.0.7:8000/").unwrap_err().to_string(),
        "replicas \"a\" and \"b\" route to the same engine (http://10.0.0.7:8000/): one engine under two names is \
         booked and scraped twice"
    );
    assert_eq!(two("http://10.0.0.8:8000"), Ok(()));
}

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
    assert!(e.contains("hint: durations are text with a unit: interval = \"5ms\" or \"5s\""), "{e}");
    // The same key in another section before it is not the one quoted.
    let e =
        NodeConfig::parse("[autoscaler]\ninterval = \"2s\"\n[replication]\ninterval = 7\n").unwrap_err().to_string();
    assert!(e.contains("interval = \"7ms\" or \"7s\""), "{e}");
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
        with("capacity_blocks = 100", "capacity_blocks = 0").unwrap_err(),
        ConfigError::Replica { replica: "vllm-0".into(), problem: "capacity_blocks must be positive".into() }
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
