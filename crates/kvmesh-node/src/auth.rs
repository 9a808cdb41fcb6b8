//! Bearer tokens for the gRPC surfaces that change things: the operator's (`Admin`, the
//! writes of `Cluster`) and the nodes' own (`Raft`, `Gossip`, forwarded writes).
//!
//! Tokens come from files or environment variables, never from the config file itself, and
//! never reach a log (`Secret`'s `Debug` is redacted). Comparison takes the same time whatever
//! the token. Without a configured token a surface is open (a trusted network, tests).

use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::Status;

/// `[security]` in the node's config. Relative file paths are from the node's working
/// directory, not the config file's.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SecuritySection {
    /// File holding the operators' token (every Admin call, cluster init/join/leave/write/
    /// fault); the environment variable `KVMESH_ADMIN_TOKEN` overrides it. In a cluster it
    /// needs `cluster_token_file` too.
    pub admin_token_file: Option<PathBuf>,
    /// File holding the token nodes present to each other (Raft, gossip, forwarded writes);
    /// `KVMESH_CLUSTER_TOKEN` overrides it. Every node of a cluster needs the same one.
    pub cluster_token_file: Option<PathBuf>,
    /// File holding the token of KV-event pushers (`Events.Publish`, engine sidecars);
    /// `KVMESH_EVENTS_TOKEN` overrides it. Without it only the admin token can push.
    pub events_token_file: Option<PathBuf>,
    /// PEM certificate chain this node serves TLS with, on the HTTP and the gRPC port (with
    /// `tls_key_file`). Absent: plain text.
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of `tls_cert_file`.
    pub tls_key_file: Option<PathBuf>,
    /// PEM CA bundle this node trusts for other nodes' certificates (Raft, gossip, forwarded
    /// writes dial peers over TLS when `tls_cert_file` is set; peers are verified against it)
    /// and, with `tls_client_auth`, for clients' certificates.
    pub tls_ca_file: Option<PathBuf>,
    /// mTLS on the gRPC port: every client (other nodes, the CLI, gateways) must present a
    /// certificate signed by `tls_ca_file`; nodes present their own `tls_cert_file`.
    pub tls_client_auth: bool,
}

/// A token, redacted in `Debug`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// A token the node cannot use ([`Secret::new`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// Nothing but whitespace.
    #[error("the token is empty")]
    Empty,
    /// Characters an HTTP/2 header value cannot carry.
    #[error("the token has characters a header cannot carry")]
    NotAHeader,
}

impl Secret {
    /// A token from a string (trimmed).
    ///
    /// # Errors
    /// An empty token, or one that cannot be sent as a header value.
    pub fn new(token: &str) -> Result<Secret, TokenError> {
        let t = token.trim();
        if t.is_empty() {
            return Err(TokenError::Empty);
        }
        if MetadataValue::try_from(format!("Bearer {t}")).is_err() {
            return Err(TokenError::NotAHeader);
        }
        Ok(Secret(t.to_string()))
    }

    /// Equal to `other`, in time that depends only on the presented token's length (not on
    /// where they differ, nor on this token's length).
    fn matches(&self, other: &str) -> bool {
        let (a, b) = (self.0.as_bytes(), other.as_bytes());
        let mut diff = (a.len() ^ b.len()) as u64;
        for (i, y) in b.iter().enumerate() {
            diff |= (a.get(i).copied().unwrap_or(0) ^ y) as u64;
        }
        diff == 0
    }

    /// Puts `authorization: Bearer <token>` on an outgoing request's metadata.
    pub fn attach(&self, meta: &mut MetadataMap) {
        if let Ok(v) = MetadataValue::try_from(format!("Bearer {}", self.0)) {
            meta.insert("authorization", v);
        }
    }
}

/// The node's tokens.
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    /// Operators'.
    pub admin: Option<Secret>,
    /// Nodes'.
    pub cluster: Option<Secret>,
    /// Event pushers'.
    pub events: Option<Secret>,
}

/// The environment variables that give `[security]`'s tokens in place of their files.
pub const ADMIN_TOKEN_ENV: &str = "KVMESH_ADMIN_TOKEN";
/// See [`ADMIN_TOKEN_ENV`].
pub const CLUSTER_TOKEN_ENV: &str = "KVMESH_CLUSTER_TOKEN";
/// See [`ADMIN_TOKEN_ENV`].
pub const EVENTS_TOKEN_ENV: &str = "KVMESH_EVENTS_TOKEN";

/// The file [`load`] reads the token from: `file`, unless environment variable `env` is set
/// (then the token is the variable's, and no file is read).
pub(crate) fn token_file<'a>(env: &str, file: &'a Option<PathBuf>) -> Option<&'a std::path::Path> {
    file.as_deref().filter(|_| std::env::var(env).is_err())
}

/// For a relative `path`, where it led: ` (ABSOLUTE, from the working directory)` (a relative
/// path in the configuration is the working directory's, not the file's); empty otherwise.
pub(crate) fn from_working_directory(path: &std::path::Path) -> String {
    match std::env::current_dir() {
        Ok(cwd) if path.is_relative() => format!(" ({}, from the working directory)", cwd.join(path).display()),
        _ => String::new(),
    }
}

/// The token in environment variable `env`, else in `file`, else none.
///
/// # Errors
/// An unreadable file or an empty or unsendable token.
pub fn load(env: &str, file: &Option<PathBuf>) -> anyhow::Result<Option<Secret>> {
    match token_file(env, file) {
        Some(path) => load_file(path).map(Some),
        None => match std::env::var(env) {
            Ok(v) => Secret::new(&v).map(Some).map_err(|e| anyhow::anyhow!("{env}: {e}")),
            Err(_) => Ok(None),
        },
    }
}

/// The token in `path`.
///
/// # Errors
/// An unreadable file or an empty or unsendable token.
pub fn load_file(path: &std::path::Path) -> anyhow::Result<Secret> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        anyhow::anyhow!("reading the token file {}{}: {e}", path.display(), from_working_directory(path))
    })?;
    Secret::new(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

impl Tokens {
    /// Reads the tokens `section` names (environment variables first).
    ///
    /// # Errors
    /// An unreadable file or an empty or unsendable token.
    pub fn load(section: &SecuritySection) -> anyhow::Result<Tokens> {
        use anyhow::Context;
        Ok(Tokens {
            admin: load(ADMIN_TOKEN_ENV, &section.admin_token_file).context("[security] admin_token_file")?,
            cluster: load(CLUSTER_TOKEN_ENV, &section.cluster_token_file).context("[security] cluster_token_file")?,
            events: load(EVENTS_TOKEN_ENV, &section.events_token_file).context("[security] events_token_file")?,
        })
    }
}

/// Accepts a request carrying one of `accepted` as its bearer token; with none configured
/// (every entry `None`), accepts any request.
///
/// # Errors
/// `UNAUTHENTICATED` with what is missing.
pub fn check(meta: &MetadataMap, accepted: &[&Option<Secret>]) -> Result<(), Status> {
    let configured: Vec<&Secret> = accepted.iter().filter_map(|s| s.as_ref()).collect();
    if configured.is_empty() {
        return Ok(());
    }
    let presented =
        meta.get("authorization").and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer ")).ok_or_else(
            || Status::unauthenticated("this call needs `authorization: Bearer <token>` (see [security])"),
        )?;
    // Every configured token is compared (no early exit on a match).
    let matched = configured.iter().fold(false, |acc, s| s.matches(presented.trim()) | acc);
    if matched {
        Ok(())
    } else {
        Err(Status::unauthenticated("the bearer token is not accepted here"))
    }
}

/// The reads that show the fleet's topology and plans (`Cluster.Status`, `Replication`'s
/// reads, `Autoscaler`'s reads): open while no admin token is configured; with one, the admin
/// or the cluster token. The data plane (`Router`), health, reflection (the public schema)
/// and KEDA's `ExternalScaler` (whose protocol carries no credential; it reveals a replica
/// count) stay open: protect them with the network, or mTLS (`tls_client_auth`).
///
/// # Errors
/// `UNAUTHENTICATED`, as [`check`].
pub fn check_read(meta: &MetadataMap, tokens: &Tokens) -> Result<(), Status> {
    if tokens.admin.is_none() {
        return Ok(());
    }
    check(meta, &[&tokens.admin, &tokens.cluster])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_relative_token_file_that_is_not_there_says_where_it_was_looked_for() {
        let e = load_file(std::path::Path::new("no-such.token")).unwrap_err().to_string();
        let cwd = std::env::current_dir().unwrap();
        let looked = format!(
            "reading the token file no-such.token ({}, from the working directory): ",
            cwd.join("no-such.token").display()
        );
        assert!(e.starts_with(&looked), "{e}");
    }

    #[test]
    fn tokens_are_checked_and_never_printed() {
        let admin = Some(Secret::new("s3cret\n").unwrap());
        let cluster = Some(Secret::new("node-token").unwrap());
        assert_eq!(format!("{:?}", admin), "Some(Secret(<redacted>))");
        let mut meta = MetadataMap::new();
        assert_eq!(check(&meta, &[&None]).map_err(|s| s.code()), Ok(()));
        assert_eq!(check(&meta, &[&admin]).unwrap_err().code(), tonic::Code::Unauthenticated);
        admin.as_ref().unwrap().attach(&mut meta);
        assert!(check(&meta, &[&admin]).is_ok());
        assert!(check(&meta, &[&None, &admin]).is_ok());
        assert_eq!(check(&meta, &[&cluster]).unwrap_err().message(), "the bearer token is not accepted here");
        assert!(check(&meta, &[&cluster, &admin]).is_ok());
        assert_eq!(Secret::new("  ").unwrap_err(), TokenError::Empty);
        assert_eq!(Secret::new("  ").unwrap_err().to_string(), "the token is empty");
        assert_eq!(Secret::new("a\nb").unwrap_err(), TokenError::NotAHeader);
    }

    #[test]
    fn reads_need_a_token_only_once_an_admin_token_is_set() {
        let (admin, cluster) = (Some(Secret::new("a").unwrap()), Some(Secret::new("c").unwrap()));
        let anonymous = MetadataMap::new();
        let only_cluster = Tokens { cluster: cluster.clone(), ..Tokens::default() };
        assert!(check_read(&anonymous, &only_cluster).is_ok());
        let both = Tokens { admin: admin.clone(), cluster: cluster.clone(), events: None };
        assert_eq!(check_read(&anonymous, &both).unwrap_err().code(), tonic::Code::Unauthenticated);
        for t in [&admin, &cluster] {
            let mut m = MetadataMap::new();
            t.as_ref().unwrap().attach(&mut m);
            assert!(check_read(&m, &both).is_ok());
        }
    }
}
