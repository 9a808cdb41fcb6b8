//! One way to reach a node's gRPC port from the CLI: `host:port` or `http://host:port` in
//! plain text, `https://host:port` over TLS, trusting the PEM CA in `KVMESH_CA_FILE` and, for
//! nodes with `[security] tls_client_auth`, presenting the client certificate and key in
//! `KVMESH_TLS_CERT_FILE` / `KVMESH_TLS_KEY_FILE`.

use anyhow::Context;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// What a command that reaches a node says when none answers: the node may be elsewhere.
pub const NODE_HINT: &str =
    "is `kvmesh node` running there? --grpc URL or KVMESH_GRPC names another node: the [node] grpc address it serves";

/// `addr` as a URL (`http://` added when it has no scheme).
pub fn url(addr: &str) -> String {
    if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    }
}

fn env_file(var: &str) -> anyhow::Result<Option<Vec<u8>>> {
    match std::env::var_os(var) {
        Some(path) => {
            std::fs::read(&path).map(Some).with_context(|| format!("{var}: reading {}", path.to_string_lossy()))
        }
        None => Ok(None),
    }
}

/// The TLS a CLI client uses for `https://` URLs.
///
/// # Errors
/// An https URL without `KVMESH_CA_FILE`, an unreadable file, or a certificate without its key.
pub fn tls() -> anyhow::Result<ClientTlsConfig> {
    let ca = env_file("KVMESH_CA_FILE")?
        .context("an https:// node needs KVMESH_CA_FILE: the PEM CA that signed the node's certificate")?;
    let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
    match (env_file("KVMESH_TLS_CERT_FILE")?, env_file("KVMESH_TLS_KEY_FILE")?) {
        (Some(cert), Some(key)) => tls = tls.identity(Identity::from_pem(cert, key)),
        (None, None) => {}
        _ => anyhow::bail!("KVMESH_TLS_CERT_FILE and KVMESH_TLS_KEY_FILE go together"),
    }
    Ok(tls)
}

/// Connects to the node at `addr`; `hint` ends the error message when it fails.
///
/// # Errors
/// A bad URL, TLS settings, or a node that does not answer.
pub async fn channel(addr: &str, hint: &str) -> anyhow::Result<Channel> {
    let url = url(addr);
    let mut endpoint = Endpoint::from_shared(url.clone()).with_context(|| format!("{url:?} is not a URL"))?;
    if url.starts_with("https://") {
        endpoint = endpoint.tls_config(tls()?)?;
    }
    // A node that does not answer fails within seconds, not at the OS's TCP timeout; one that
    // vanishes under a long stream (`autoscaler watch`) within a keep-alive ping.
    endpoint = endpoint
        .connect_timeout(std::time::Duration::from_secs(5))
        .http2_keep_alive_interval(std::time::Duration::from_secs(10))
        .keep_alive_timeout(std::time::Duration::from_secs(10));
    endpoint.connect().await.with_context(|| format!("connecting to {url} ({hint})"))
}

/// A failed gRPC `call` in words: the node's message without gRPC's status dump, and for the
/// two mistakes a new user makes most — no or the wrong admin token, a `--grpc` that is not a
/// gRPC port — what to do about it. `token` says where the admin token came from
/// ([`crate::cluster::token_source`]).
pub fn explain(call: &str, s: &tonic::Status, token: &str) -> anyhow::Error {
    use tonic::Code;
    let what = if s.message().is_empty() { format!("{:?}", s.code()) } else { s.message().to_string() };
    match s.code() {
        Code::Unauthenticated | Code::PermissionDenied => anyhow::anyhow!(
            "{call}: {what} (admin token: {token}; pass --token-file FILE or set KVMESH_ADMIN_TOKEN to the node's \
             admin token)"
        ),
        Code::Unavailable | Code::Unknown | Code::Internal
            if what.contains("transport error") || what.contains("h2 protocol error") =>
        {
            anyhow::anyhow!(
                "{call}: {what} (no gRPC answer: is --grpc the node's gRPC address, `node.grpc`, and not its HTTP \
                 port?)"
            )
        }
        _ => anyhow::anyhow!("{call}: {what}"),
    }
}

#[cfg(test)]
mod tests {
    use super::explain;

    #[test]
    fn a_refused_token_and_a_wrong_port_say_what_to_do() {
        let s = tonic::Status::unauthenticated("the bearer token is not accepted here");
        assert_eq!(
            explain("Cluster.Status", &s, "from KVMESH_ADMIN_TOKEN").to_string(),
            "Cluster.Status: the bearer token is not accepted here (admin token: from KVMESH_ADMIN_TOKEN; pass \
             --token-file FILE or set KVMESH_ADMIN_TOKEN to the node's admin token)"
        );
        let s = tonic::Status::unknown("transport error");
        assert!(explain("Admin.ListReplicas", &s, "none sent").to_string().ends_with("and not its HTTP port?)"));
        let s = tonic::Status::not_found("unknown replica \"x\"");
        assert_eq!(
            explain("Admin.DrainReplica", &s, "none sent").to_string(),
            "Admin.DrainReplica: unknown replica \"x\""
        );
    }
}
