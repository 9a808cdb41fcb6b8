//! What a node checks before it binds a port: the configuration's values, the token and TLS
//! files `[security]` names, and that a cluster is never left open by accident. `kvmesh node
//! --check` runs the same, and stops there.

use crate::auth::Tokens;
use crate::config::NodeConfig;
use crate::tls::Tls;

/// What the checks found, for the node to use.
pub struct Preflight {
    /// TLS, when `tls_cert_file` is set.
    pub tls: Option<Tls>,
    /// `node.tokenizer` loaded (the approximate scheme without one).
    pub tokenizer: crate::tokenize::Tokenizer,
    /// The bearer tokens `[security]` names (environment variables first).
    pub tokens: Tokens,
    /// Valid but worth a warning at every start: [`NodeConfig::doubts`], and a cluster run
    /// open by `insecure`.
    pub warnings: Vec<String>,
}

/// Checks `config` as [`crate::start`] does before binding anything.
///
/// # Errors
/// [`NodeConfig::validate`]'s; an unreadable or empty token file; unusable TLS files; a
/// tokenizer that does not load; a
/// cluster serving TLS without `tls_ca_file`; an admin token without a cluster token in a
/// cluster (Raft would be open); a cluster with neither a cluster token nor mTLS unless
/// `insecure`.
pub fn check(config: &NodeConfig) -> anyhow::Result<Preflight> {
    config.validate()?;
    let tokens = Tokens::load(&config.security)?;
    let tls = Tls::load(&config.security)?;
    let tokenizer = crate::tokenize::Tokenizer::load(config.node.tokenizer.as_deref())
        .map_err(|e| anyhow::anyhow!("node.tokenizer: {e:#}"))?;
    let mut warnings = config.doubts();
    if let Some(c) = &config.cluster {
        // Peers dial this node at its own entry in `peers`: checked again on the bound port.
        if config.node.grpc.port() != 0 {
            c.check_own_peer(config.node.grpc.port())?;
        }
        if tls.is_some() && config.security.tls_ca_file.is_none() {
            anyhow::bail!(
                "[security] a cluster serving TLS needs tls_ca_file: the CA its nodes verify each other with"
            );
        }
        if tokens.admin.is_some() && tokens.cluster.is_none() {
            anyhow::bail!(
                "[security]: an admin token without a cluster token would leave Raft and gossip open to anyone who can \
                 reach the gRPC port; set cluster_token_file (or KVMESH_CLUSTER_TOKEN) too"
            );
        }
        let authenticated = tokens.cluster.is_some() || config.security.tls_client_auth;
        if !authenticated && !c.insecure {
            anyhow::bail!(
                "[cluster] without authentication: anyone who reaches the gRPC port could join Raft, forge a leader \
                 and write the registry. Give every node the same cluster token (e.g. `openssl rand -hex 32 > \
                 cluster.token`, then `[security] cluster_token_file = \"cluster.token\"` or KVMESH_CLUSTER_TOKEN), \
                 or mTLS (`[security] tls_client_auth`); or, on a network you trust, `--insecure` \
                 (`[cluster] insecure = true`)"
            );
        }
        if !authenticated {
            warnings.push(
                "cluster running INSECURE (--insecure): Raft, gossip and registry writes are open to anyone who can \
                 reach the gRPC port"
                    .into(),
            );
        }
    }
    Ok(Preflight { tls, tokenizer, tokens, warnings })
}
