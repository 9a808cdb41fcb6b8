//! The configuration's unit tests: loading, validation and every refusal's message.

use super::*;
use kvmesh_core::Role;

pub(super) const EXAMPLE: &str = r#"
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
    assert_eq!(with("[\"m\"]").unwrap_err().to_string(), "node.lora_adapters has the base model's name \"m\"");
    assert_eq!(with("[\"\"]").unwrap_err().to_string(), "node.lora_adapters has an empty entry (remove it)");
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
    // Two members: valid, but said (a majority of two is both).
    assert_eq!(
        c.doubts(),
        ["cluster.peers lists 2 nodes: Raft needs a majority, so the tier stops when either is down; run 3 (or 5) to \
          survive losing one (or two)"]
    );
    assert_eq!(c.cluster.unwrap().peer_map().unwrap().get(&2).map(String::as_str), Some("b:2"));
    let c: NodeConfig = toml::from_str(&clustered.replace("3=c:3", "2=a:1")).unwrap();
    assert_eq!(
        c.validate().unwrap_err().to_string(),
        "cluster.peers lists a:1 for ids 1 and 2: each node serves at an address of its own"
    );
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
    let refused = two("http://10.0.0.7:8000/").unwrap_err();
    assert_eq!(
        refused.to_string(),
        "replica \"b\": http routes to the same engine as replica \"a\" (http://10.0.0.7:8000/): one engine under \
         two names is booked and scraped twice"
    );
    // `--check` points at the second entry's `http`.
    let text = "[[replicas]]\nname = \"a\"\nhttp = \"http://10.0.0.7:8000\"\ncapacity_blocks = 10\n\
                [[replicas]]\nname = \"b\"\nhttp = \"http://10.0.0.7:8000/\"\ncapacity_blocks = 10\n";
    assert_eq!(refused.line_in(text), Some(7));
    assert_eq!(two("http://10.0.0.8:8000"), Ok(()));
}

#[test]
fn a_repeated_name_is_refused_at_the_repeat() {
    let text = "[[replicas]]\nname = \"a\"\nhttp = \"http://10.0.0.7:8000\"\ncapacity_blocks = 10\n\
                [[replicas]]\nname = \"a\"   # again\nhttp = \"http://10.0.0.8:8000\"\ncapacity_blocks = 10\n";
    let refused = toml::from_str::<NodeConfig>(text).unwrap().validate().unwrap_err();
    assert_eq!(refused.to_string(), "replica \"a\": the name appears twice");
    assert_eq!(refused.line_in(text), Some(6));
}

mod durations;

#[test]
fn refusals_are_one_per_part_in_order_and_validate_gives_the_first() {
    let text = EXAMPLE
        .replacen("[node]\n", "[node]\nblock_size = 0\nproxy_threads = 0\n", 1)
        .replace("= 100", "= 0\nengine = \"sglang\"")
        + "[limits]\nhttp_max_connections = 0\n";
    let c: NodeConfig = toml::from_str(&text).unwrap();
    let all: Vec<String> = c.refusals().iter().map(ToString::to_string).collect();
    // [node]'s first only (block_size, not proxy_threads), then [limits], then the replica.
    assert_eq!(
        all,
        [
            "node.block_size must be positive",
            "limits.http_max_connections must be positive",
            "replica \"vllm-0\": capacity_blocks is required for an sglang engine (its metrics do not report its \
             KV capacity): set it to the engine's max_total_num_tokens / block size"
        ]
    );
    assert_eq!(c.validate().unwrap_err().to_string(), all[0]);
    assert!(toml::from_str::<NodeConfig>(EXAMPLE).unwrap().refusals().is_empty());
}

#[test]
fn capacity_left_out_is_read_from_a_vllm_engine_and_required_where_it_cannot_be() {
    let without = EXAMPLE.replace("capacity_blocks = 100\n", "");
    let c: NodeConfig = toml::from_str(&without).unwrap();
    assert_eq!(c.replicas[0].capacity_blocks, 0, "0: read from the engine's metrics page");
    c.validate().unwrap();
    let refused = |extra: &str| {
        let c: NodeConfig = toml::from_str(&format!("{without}{extra}\n")).unwrap();
        c.replicas.iter().find_map(|r| r.validate().err()).map(|e| e.to_string())
    };
    assert_eq!(
        refused("engine = \"sglang\"").as_deref(),
        Some(
            "replica \"vllm-0\": capacity_blocks is required for an sglang engine (its metrics do not report its KV \
             capacity): set it to the engine's max_total_num_tokens / block size"
        )
    );
    assert_eq!(
        refused("data_parallel_rank = 1").as_deref(),
        Some(
            "replica \"vllm-0\": capacity_blocks is required for data-parallel ranks (vLLM reports the ranks' KV \
             blocks summed): set it to one rank's blocks, its log's \"GPU KV cache size: N tokens\" / block_size"
        )
    );
    assert_eq!(refused("data_parallel_rank = 1\ncapacity_blocks = 7"), None);
    // Written as a size, it is refused before the ranks are written out: under the file's name.
    let sized: NodeConfig = toml::from_str(&format!("{without}data_parallel_size = 2\n")).unwrap();
    assert_eq!(
        sized.replicas[0].ranks().unwrap_err().to_string(),
        refused("data_parallel_rank = 1").unwrap(),
        "the same refusal, naming vllm-0"
    );
}
