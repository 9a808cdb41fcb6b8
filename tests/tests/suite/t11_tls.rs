//! TLS on a node's ports and between nodes (`[security] tls_*`), with certificates made here
//! by a throwaway CA (rcgen): HTTPS completions through the proxy, gRPC over TLS, plain text
//! refused, a 3-node cluster whose Raft and gossip run over mTLS, a client without a
//! certificate refused, and clear errors for half-configured TLS.

use kvmesh_engine_sim::EngineSimConfig;
use kvmesh_node::auth::SecuritySection;
use kvmesh_node::config::{ClusterSection, NodeConfig, NodeSection, ReplicaConfig};
use kvmesh_proto::v1;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

/// A CA, and two certificates it signed for 127.0.0.1 / localhost (a server's and a
/// client's), written as PEM files in `dir`.
struct Pki {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
}

fn pki(dir: &Path) -> Pki {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let leaf = |name: &str| {
        let key = KeyPair::generate().unwrap();
        let params = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
        let cert = params.signed_by(&key, &ca).unwrap();
        let (c, k) = (dir.join(format!("{name}.pem")), dir.join(format!("{name}.key")));
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        (c, k)
    };
    let (cert, key) = leaf("node");
    let (client_cert, client_key) = leaf("client");
    let ca_path = dir.join("ca.pem");
    std::fs::write(&ca_path, ca.pem()).unwrap();
    Pki { ca: ca_path, cert, key, client_cert, client_key }
}

fn security(p: &Pki, client_auth: bool) -> SecuritySection {
    SecuritySection {
        tls_cert_file: Some(p.cert.clone()),
        tls_key_file: Some(p.key.clone()),
        tls_ca_file: Some(p.ca.clone()),
        tls_client_auth: client_auth,
        ..SecuritySection::default()
    }
}

fn client_tls(p: &Pki, identity: bool) -> ClientTlsConfig {
    let tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(std::fs::read(&p.ca).unwrap()));
    if identity {
        tls.identity(Identity::from_pem(std::fs::read(&p.client_cert).unwrap(), std::fs::read(&p.client_key).unwrap()))
    } else {
        tls
    }
}

async fn grpc(
    addr: std::net::SocketAddr,
    tls: ClientTlsConfig,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    Endpoint::from_shared(format!("https://{addr}")).unwrap().tls_config(tls)?.connect().await
}

/// POSTs a completion over HTTPS by hand (reqwest is built without TLS here) and returns the
/// status line.
async fn https_completion(addr: std::net::SocketAddr, ca: &Path) -> String {
    let mut roots = tokio_rustls::rustls::RootCertStore::empty();
    use rustls_pki_types::pem::PemObject;
    for c in rustls_pki_types::CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let config = tokio_rustls::rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
    let mut tls = connector.connect(name, tcp).await.unwrap();
    let body = r#"{"model":"m","prompt":"hello over tls","max_tokens":2}"#;
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    tls.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let _ = tls.read_to_end(&mut out).await;
    String::from_utf8_lossy(&out).lines().next().unwrap_or_default().to_string()
}

fn section() -> NodeSection {
    NodeSection {
        http: "127.0.0.1:0".parse().unwrap(),
        grpc: "127.0.0.1:0".parse().unwrap(),
        scrape_interval: std::time::Duration::from_millis(100),
        ..NodeSection::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_serves_https_and_grpc_over_tls_and_refuses_plain_text() {
    let dir = tempfile::tempdir().unwrap();
    let p = pki(dir.path());
    let engine = kvmesh_engine_sim::start(EngineSimConfig { speed: 20.0, ..EngineSimConfig::default() }).await.unwrap();
    let replica = ReplicaConfig { replay: None, ..kvmesh_tests::node::replica(0, &engine) };
    let config = NodeConfig { security: security(&p, false), ..kvmesh_tests::node::single(section(), vec![replica]) };
    let node = kvmesh_node::start(config).await.unwrap();
    assert_eq!(https_completion(node.http, &p.ca).await, "HTTP/1.1 200 OK");
    // Plain HTTP to the TLS port gets no answer.
    let plain =
        reqwest::Client::new().get(format!("http://{}/health", node.http)).timeout(Duration::from_secs(2)).send().await;
    assert!(plain.is_err(), "plain text was answered: {plain:?}");
    // gRPC over TLS works; plain text does not.
    let ch = grpc(node.grpc, client_tls(&p, false)).await.unwrap();
    let list = v1::admin_client::AdminClient::new(ch).list_replicas(v1::ListReplicasRequest {}).await.unwrap();
    assert_eq!(list.into_inner().replicas.len(), 1);
    let plain = Endpoint::from_shared(format!("http://{}", node.grpc)).unwrap().connect().await.unwrap();
    assert!(v1::admin_client::AdminClient::new(plain).list_replicas(v1::ListReplicasRequest {}).await.is_err());
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_runs_raft_over_mtls_and_refuses_clients_without_a_certificate() {
    let _serial = crate::common::serial().await;
    let dir = tempfile::tempdir().unwrap();
    let p = pki(dir.path());
    let ls: Vec<std::net::TcpListener> = (0..3).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let ports: Vec<u16> = ls.iter().map(|l| l.local_addr().unwrap().port()).collect();
    drop(ls);
    let mut nodes = Vec::new();
    for id in 1..=3u64 {
        let node = NodeSection { grpc: format!("127.0.0.1:{}", ports[id as usize - 1]).parse().unwrap(), ..section() };
        let cluster = ClusterSection {
            id,
            peers: ports.iter().enumerate().map(|(i, port)| format!("{}=127.0.0.1:{port}", i + 1)).collect(),
            data_dir: dir.path().join(format!("node{id}")),
            insecure: true,
            ..ClusterSection::default()
        };
        let config = NodeConfig {
            node,
            replicas: vec![],
            cluster: Some(cluster),
            security: security(&p, true),
            replication: Default::default(),
            autoscaler: Default::default(),
            admission: Default::default(),
            limits: Default::default(),
            epp: Default::default(),
        };
        nodes.push(kvmesh_node::start(config).await.unwrap());
    }
    // Without a client certificate the handshake (or the call) fails.
    let anonymous = grpc(nodes[0].grpc, client_tls(&p, false)).await;
    let refused = match anonymous {
        Err(_) => true,
        Ok(ch) => v1::cluster_client::ClusterClient::new(ch).status(v1::ClusterStatusRequest {}).await.is_err(),
    };
    assert!(refused, "a client without a certificate was served");
    // With one: bootstrap, and Raft elects a leader and replicates a write over mTLS.
    let ch = grpc(nodes[0].grpc, client_tls(&p, true)).await.unwrap();
    let mut c = v1::cluster_client::ClusterClient::new(ch);
    c.init(v1::InitRequest {}).await.unwrap();
    let write = br#"{"op":"set_policy","policy":"kv_cost","params":{}}"#.to_vec();
    c.write(v1::WriteRequest { command_json: write }).await.unwrap();
    let t0 = Instant::now();
    while !nodes.iter().all(|n| &*n.shared.policy_name() == "kv_cost") {
        assert!(t0.elapsed() < Duration::from_secs(10), "the write did not reach every node over TLS");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for n in nodes {
        n.stop().await;
    }
}

#[tokio::test]
async fn half_configured_tls_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let p = pki(dir.path());
    let start = |security: SecuritySection| async move {
        let config = NodeConfig {
            node: section(),
            replicas: vec![],
            cluster: None,
            security,
            replication: Default::default(),
            autoscaler: Default::default(),
            admission: Default::default(),
            limits: Default::default(),
            epp: Default::default(),
        };
        kvmesh_node::start(config).await.err().map(|e| format!("{e:#}"))
    };
    let only_cert = SecuritySection { tls_key_file: None, ..security(&p, false) };
    assert_eq!(start(only_cert).await.unwrap(), "[security] tls_cert_file and tls_key_file go together");
    let no_ca = SecuritySection { tls_ca_file: None, ..security(&p, true) };
    assert_eq!(
        start(no_ca).await.unwrap(),
        "[security] tls_client_auth needs tls_ca_file (the CA that signs client certificates)"
    );
    let missing = SecuritySection { tls_key_file: Some(dir.path().join("nope.key")), ..security(&p, false) };
    let e = start(missing).await.unwrap();
    assert!(e.starts_with("[security] tls_key_file: reading ") && e.contains("nope.key"), "{e}");
}
