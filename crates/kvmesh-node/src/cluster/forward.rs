//! Writes and joins a follower forwards to the leader, signed as the node's (see
//! [`super::operator`] for an operator's own credential riding along).

use super::*;
use kvmesh_proto::v1;
use registry::{Command, CommandResult};

/// Marks a request as forwarded by a node and signs it with the nodes' token. The leader
/// takes the nodes' token as the *node's* credential only; an operator's write forwarded
/// carries the operator's own too ([`operator`]).
pub(super) fn mark_forwarded(meta: &mut tonic::metadata::MetadataMap, token: &Option<crate::auth::Secret>) {
    meta.insert(FORWARDED, tonic::metadata::MetadataValue::from_static("1"));
    if let Some(t) = token {
        t.attach(meta);
    }
}

pub(super) fn channel_to(
    addr: &str,
    tls: Option<&tonic::transport::ClientTlsConfig>,
) -> Result<tonic::transport::Channel, ClusterError> {
    network::channel(addr, tls).map_err(|e| ClusterError::Forward { addr: addr.into(), error: e.to_string() })
}

pub(super) async fn forward_join(
    leader: &str,
    id: u64,
    addr: String,
    token: &Option<crate::auth::Secret>,
    tls: Option<&tonic::transport::ClientTlsConfig>,
) -> Result<(), ClusterError> {
    let mut c = v1::cluster_client::ClusterClient::new(channel_to(leader, tls)?);
    let mut request = tonic::Request::new(v1::JoinRequest { node_id: id, addr });
    mark_forwarded(request.metadata_mut(), token);
    operator::attach(request.metadata_mut());
    c.join(request).await.map(|_| ()).map_err(|s| from_forwarded(leader, &s))
}

/// The leader's answer to a forwarded request, as this node's own error.
pub(super) fn from_forwarded(addr: &str, s: &tonic::Status) -> ClusterError {
    match s.code() {
        tonic::Code::FailedPrecondition | tonic::Code::InvalidArgument => {
            ClusterError::Rejected(s.message().to_string())
        }
        tonic::Code::Unavailable if s.message().starts_with("no Raft leader") => ClusterError::NoLeader,
        tonic::Code::DeadlineExceeded if s.message().starts_with("not committed") => ClusterError::NotCommitted,
        _ => ClusterError::Forward { addr: addr.to_string(), error: s.message().to_string() },
    }
}

/// Why a forwarded write failed.
pub(super) enum Forwarded {
    /// The leader refused the connection: nothing was sent.
    Refused(ClusterError),
    /// Anything else (the write may or may not have been applied).
    Failed(ClusterError),
}

pub(super) async fn forward_write(
    addr: &str,
    cmd: &Command,
    token: &Option<crate::auth::Secret>,
    tls: Option<&tonic::transport::ClientTlsConfig>,
) -> Result<(CommandResult, u64), Forwarded> {
    let fwd = |error: String| Forwarded::Failed(ClusterError::Forward { addr: addr.to_string(), error });
    let mut c = v1::cluster_client::ClusterClient::new(channel_to(addr, tls).map_err(Forwarded::Failed)?);
    let json = serde_json::to_vec(cmd).map_err(|e| fwd(e.to_string()))?;
    let mut request = tonic::Request::new(v1::WriteRequest { command_json: json });
    mark_forwarded(request.metadata_mut(), token);
    operator::attach(request.metadata_mut());
    let reply = c.write(request).await.map_err(|s| {
        let e = from_forwarded(addr, &s);
        if connection_refused(&s) {
            Forwarded::Refused(e)
        } else {
            Forwarded::Failed(e)
        }
    })?;
    let r = reply.into_inner();
    let result: CommandResult = serde_json::from_slice(&r.result_json).map_err(|e| fwd(e.to_string()))?;
    Ok((result, r.log_index))
}

/// Whether `s` reports a refused TCP connection (somewhere in its source chain).
fn connection_refused(s: &tonic::Status) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(s);
    while let Some(e) = source {
        if e.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused) {
            return true;
        }
        source = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_forward_to_a_closed_port_is_refused_and_a_bad_reply_is_not() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let cmd = Command::RemoveReplica { name: "e0".into() };
        let refused = forward_write(&closed.to_string(), &cmd, &None, None).await;
        assert!(matches!(refused, Err(Forwarded::Refused(ClusterError::Forward { .. }))));
        // Something listens but does not speak gRPC: the write may have been read, so it is
        // not retried.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                use tokio::io::AsyncWriteExt;
                let _ = s.write_all(b"HTTP/1.1 500 nope\r\n\r\n").await;
            }
        });
        let failed = forward_write(&addr.to_string(), &cmd, &None, None).await;
        assert!(matches!(failed, Err(Forwarded::Failed(_))));
    }
}
