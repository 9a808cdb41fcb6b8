//! Whose write a forwarded write is. A follower that forwards an operator's registry write
//! to the leader passes the operator's own credential along, and the leader checks it against
//! the admin token itself: the cluster token (which every node holds) is never an operator's
//! credential, and no header merely *claims* one.
//!
//! ```text
//! operator ─authorization: admin─► follower ─authorization: cluster, x-kvmesh-operator-authorization: admin─► leader
//!                                                                   (both verified)
//! ```
//!
//! The operator's credential travels with the call in a task-local: [`Scoped`] wraps the
//! services operators call (`Admin`, `Cluster`) and scopes the call's `authorization` (on a
//! call forwarded already, the operator's header) over its handler; node-initiated writes
//! (autoscaler decisions, replication plans) run outside any scope and are forwarded as the
//! node's own. The cluster token is still the cluster's master key: its holder can send Raft
//! messages and the nodes' own writes, so keep it as secret as the admin token.

use std::task::{Context, Poll};
use tonic::metadata::{AsciiMetadataValue, MetadataMap};

/// Metadata carrying a forwarded operator's `authorization`, verified by the leader.
pub const OPERATOR_AUTH: &str = "x-kvmesh-operator-authorization";

tokio::task_local! {
    static CALLER: Option<AsciiMetadataValue>;
}

/// The `authorization` of the operator call this task serves, if it serves one.
pub fn current() -> Option<AsciiMetadataValue> {
    CALLER.try_with(|c| c.clone()).ok().flatten()
}

/// Puts the operator's credential on a request to forward, when the task serves an operator.
pub fn attach(meta: &mut MetadataMap) {
    if let Some(v) = current() {
        meta.insert(OPERATOR_AUTH, v);
    }
}

/// The forwarded operator's credential as the leader checks it: a map whose `authorization`
/// is what the follower was given.
pub fn forwarded_credential(meta: &MetadataMap) -> MetadataMap {
    let mut m = MetadataMap::new();
    if let Some(v) = meta.get(OPERATOR_AUTH) {
        m.insert("authorization", v.clone());
    }
    m
}

/// A gRPC service whose calls run with their `authorization` in scope (see [`current`]).
#[derive(Debug, Clone)]
pub struct Scoped<S>(pub S);

impl<S, B> tower::Service<http::Request<B>> for Scoped<S>
where
    S: tower::Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = tokio::task::futures::TaskLocalFuture<Option<AsciiMetadataValue>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        // A call another node forwarded carries the operator's credential in its own header
        // (its `authorization` is the nodes' token): that is what goes on if it is forwarded
        // again.
        let header = if req.headers().contains_key(super::FORWARDED) { OPERATOR_AUTH } else { "authorization" };
        let auth = req.headers().get(header).and_then(|v| AsciiMetadataValue::try_from(v.as_bytes()).ok());
        CALLER.scope(auth, self.0.call(req))
    }
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for Scoped<S> {
    const NAME: &'static str = S::NAME;
}
