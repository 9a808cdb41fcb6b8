//! deploy/: the Kubernetes manifests parse, hang together (the StatefulSet's service is the
//! headless one, every node gets a volume), and the node configuration they ship is valid.

use kvmesh_node::config::NodeConfig;
use serde::Deserialize;
use serde_json::Value;
use std::path::PathBuf;

fn documents() -> Vec<Value> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/router-tier.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text).map(|d| Value::deserialize(d).unwrap()).collect()
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in deploy/router-tier.yaml"))
}

#[test]
fn the_router_tier_manifest_is_consistent() {
    let docs = documents();
    assert_eq!(docs.len(), 5);
    let sts = find(&docs, "StatefulSet", "kvmesh");
    let headless = find(&docs, "Service", "kvmesh-raft");
    assert_eq!(headless["spec"]["clusterIP"], "None");
    assert_eq!(sts["spec"]["serviceName"], "kvmesh-raft");
    assert_eq!(sts["spec"]["replicas"], 3);
    assert_eq!(sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"], "data");
    let container = &sts["spec"]["template"]["spec"]["containers"][0];
    let env: Vec<&str> = container["env"].as_array().unwrap().iter().map(|e| e["name"].as_str().unwrap()).collect();
    assert!(env.contains(&"KVMESH_PEERS") && env.contains(&"KVMESH_DATA_DIR"), "{env:?}");
    let peers = container["env"].as_array().unwrap().iter().find(|e| e["name"] == "KVMESH_PEERS").unwrap()["value"]
        .as_str()
        .unwrap();
    assert_eq!(peers.split(',').count(), 3);
    assert_eq!(find(&docs, "Service", "kvmesh")["spec"]["ports"].as_array().unwrap().len(), 2);
    find(&docs, "Job", "kvmesh-bootstrap");

    // The shipped node config is valid once the pod's environment supplies the cluster id.
    let toml = find(&docs, "ConfigMap", "kvmesh-config")["data"]["kvmesh.toml"].as_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("kvmesh.toml");
    std::fs::write(&file, toml).unwrap();
    let mut config = NodeConfig::read(&file).unwrap();
    let cluster = config.cluster.as_mut().expect("a [cluster] section");
    cluster.id = 1;
    cluster.peers = peers.split(',').map(String::from).collect();
    config.validate().unwrap();
    assert_eq!(config.node.block_size, 16);
    // A stopping node drains within the pod's grace period.
    let pod_grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"].as_f64().unwrap();
    let grace = config.node.shutdown_grace.as_secs_f64();
    assert!(grace + 10.0 <= pod_grace, "{grace} vs {pod_grace}");
}

/// The one document in deploy/`file`, as JSON.
fn manifest(file: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy").join(file);
    let text = std::fs::read_to_string(&path).unwrap();
    serde_yaml_ng::from_str::<serde_yaml_ng::Value>(&text).map(|v| serde_json::to_value(v).unwrap()).unwrap()
}

#[test]
fn the_keda_scaled_object_points_at_kvmesh() {
    let so = manifest("keda/scaledobject.yaml");
    assert_eq!(so["apiVersion"].as_str(), Some("keda.sh/v1alpha1"));
    assert_eq!(so["kind"].as_str(), Some("ScaledObject"));
    let trigger = &so["spec"]["triggers"][0];
    assert_eq!(trigger["type"].as_str(), Some("external-push"));
    // The client Service of router-tier.yaml, on its gRPC port; the tier's default pool.
    assert_eq!(trigger["metadata"]["scalerAddress"].as_str(), Some("kvmesh.default.svc.cluster.local:50051"));
    assert_eq!(
        trigger["metadata"]["pool"].as_str(),
        Some(kvmesh_node::config::AutoscalerSection::default().pool.as_str())
    );
    let docs = documents();
    let svc = find(&docs, "Service", "kvmesh");
    let grpc = svc["spec"]["ports"].as_array().unwrap().iter().any(|p| p["port"].as_u64() == Some(50051));
    assert!(grpc, "the client Service exposes gRPC 50051");
}

#[test]
fn the_engine_deployment_is_what_keda_scales_and_drains_within_its_grace_period() {
    let dep = manifest("engines.yaml");
    let so = manifest("keda/scaledobject.yaml");
    assert_eq!(dep["kind"], "Deployment");
    assert_eq!(so["spec"]["scaleTargetRef"]["name"], dep["metadata"]["name"]);
    assert_eq!(so["metadata"]["namespace"], dep["metadata"]["namespace"]);
    let pod = &dep["spec"]["template"]["spec"];
    let sidecar = pod["containers"].as_array().unwrap().iter().find(|c| c["name"] == "kvmesh").unwrap();
    // The sidecar talks to the same router Service KEDA asks.
    let grpc = sidecar["env"].as_array().unwrap().iter().find(|e| e["name"] == "KVMESH_GRPC").unwrap()["value"]
        .as_str()
        .unwrap();
    assert_eq!(grpc.strip_prefix("http://"), so["spec"]["triggers"][0]["metadata"]["scalerAddress"].as_str());
    // The drain gives up before Kubernetes kills the pod, and the engine serves until then.
    let hook = sidecar["lifecycle"]["preStop"]["exec"]["command"][2].as_str().unwrap();
    let timeout: u64 = hook.split("--timeout ").nth(1).unwrap().split_whitespace().next().unwrap().parse().unwrap();
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(timeout < grace && timeout >= kvmesh_node::config::NodeSection::default().request_timeout.as_secs());
    let engine = &pod["containers"][0];
    let wait = engine["lifecycle"]["preStop"]["exec"]["command"][2].as_str().unwrap();
    let engine_s: u64 = wait.split("seq ").nth(1).unwrap().split(')').next().unwrap().parse().unwrap();
    assert!(timeout < engine_s && engine_s < grace, "{timeout} < {engine_s} < {grace}");
    assert!(wait.contains("/drain/done") && hook.ends_with("touch /drain/done\n"), "{hook}");
}

/// The InferencePool selects the engine pods of engines.yaml on the port they register with
/// kvmesh (so the gateway's endpoints are the `<ip:port>` kvmesh names), and its endpoint
/// picker is the router tier's client Service on its gRPC port.
#[test]
fn the_inference_pool_picks_through_kvmesh_among_the_engine_pods() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/gateway/inference-pool.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let docs: Vec<Value> =
        serde_yaml_ng::Deserializer::from_str(&text).map(|d| Value::deserialize(d).unwrap()).collect();
    let pool = docs.iter().find(|d| d["kind"] == "InferencePool").expect("an InferencePool");
    assert_eq!(pool["apiVersion"], "inference.networking.k8s.io/v1");
    let picker = &pool["spec"]["endpointPickerRef"];
    assert_eq!((picker["kind"].as_str(), picker["name"].as_str()), (Some("Service"), Some("kvmesh")));
    assert_eq!(picker["port"]["number"].as_u64(), Some(50051));
    assert!(matches!(picker["failureMode"].as_str(), Some("FailClose" | "FailOpen")));
    let tier = documents();
    let svc = find(&tier, "Service", "kvmesh");
    assert!(svc["spec"]["ports"].as_array().unwrap().iter().any(|p| p["port"].as_u64() == Some(50051)));
    // engines.yaml: the pods' labels and the port their sidecar registers.
    let engines_text = std::fs::read_to_string(path.with_file_name("../engines.yaml")).unwrap();
    let engines: Vec<Value> =
        serde_yaml_ng::Deserializer::from_str(&engines_text).map(|d| Value::deserialize(d).unwrap()).collect();
    let deployment = engines.iter().find(|d| d["kind"] == "Deployment").unwrap();
    // The pool, its picker Service and the engine pods share a namespace (the pool looks both
    // up in its own).
    assert_eq!(pool["metadata"]["namespace"], deployment["metadata"]["namespace"]);
    assert!(text.contains("kubectl apply -n llm -f deploy/router-tier.yaml"), "the router tier goes there too");
    let labels = &deployment["spec"]["template"]["metadata"]["labels"];
    for (k, v) in pool["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(&labels[k], v, "the pool selects the engine pods by {k}");
    }
    let port = pool["spec"]["targetPorts"][0]["number"].as_u64().unwrap();
    assert!(engines_text.contains(&format!("--http \"http://$POD_IP:{port}\"")), "engines register at :{port}");
    let route = docs.iter().find(|d| d["kind"] == "HTTPRoute").expect("an HTTPRoute");
    let backend = &route["spec"]["rules"][0]["backendRefs"][0];
    assert_eq!(
        (backend["kind"].as_str(), backend["name"].as_str()),
        (Some("InferencePool"), pool["metadata"]["name"].as_str())
    );
}

/// The Grafana dashboard is valid JSON whose every panel queries Prometheus, and the alert
/// rules a PrometheusRule whose every rule has a name, an expression and a summary (the
/// names they use are checked against a node's page in t06 and t12).
#[test]
fn the_dashboard_and_alert_rules_parse() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/observability");
    let dash: Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("grafana-dashboard.json")).unwrap()).unwrap();
    let panels = dash["panels"].as_array().unwrap();
    assert!(panels.len() >= 12);
    for p in panels {
        let targets = p["targets"].as_array().unwrap();
        assert!(
            !targets.is_empty() && targets.iter().all(|t| t["expr"].as_str().is_some_and(|e| e.contains("kvmesh_")))
        );
    }
    let rules = manifest("observability/alerts.yaml");
    assert_eq!(rules["kind"], "PrometheusRule");
    let rules = rules["spec"]["groups"][0]["rules"].as_array().unwrap();
    let names: Vec<&str> = rules.iter().map(|r| r["alert"].as_str().unwrap()).collect();
    for want in [
        "KvmeshReplicaUnhealthy",
        "KvmeshEventLagHigh",
        "KvmeshGossipLag",
        "KvmeshLeaderChanges",
        "KvmeshAdmissionRefusals",
    ] {
        assert!(names.contains(&want), "{want} in {names:?}");
    }
    assert!(rules.iter().all(|r| r["expr"].is_string() && r["annotations"]["summary"].is_string()));
    // The PodMonitor scrapes the router pods' named HTTP port.
    let pm = manifest("observability/podmonitor.yaml");
    let sts = find(&documents(), "StatefulSet", "kvmesh").clone();
    let template = &sts["spec"]["template"];
    for (k, v) in pm["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(&template["metadata"]["labels"][k], v);
    }
    let port = pm["spec"]["podMetricsEndpoints"][0]["port"].as_str().unwrap();
    let ports = template["spec"]["containers"][0]["ports"].as_array().unwrap();
    assert!(ports.iter().any(|p| p["name"] == port), "the pods have a port named {port}");
}
