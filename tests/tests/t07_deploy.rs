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
}
