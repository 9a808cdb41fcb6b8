//! `kvmesh cluster …`: bootstrap, grow, shrink and inspect a cluster of router nodes over gRPC
//! (`kvmesh.v1.Cluster`).

use crate::cli::{ClusterCommand, ClusterTarget};
use kvmesh_proto::v1;

pub fn run(cmd: &ClusterCommand) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        match cmd {
            ClusterCommand::Init(t) => {
                let status = answer(client(t).await?.init(authed(t, v1::InitRequest {})?).await, "Cluster.Init", t)?;
                println!("cluster initialized");
                print!("{}", render(&status));
            }
            ClusterCommand::Join(a) => {
                let req = v1::JoinRequest { node_id: a.id, addr: a.addr.clone() };
                let status =
                    answer(client(&a.target).await?.join(authed(&a.target, req)?).await, "Cluster.Join", &a.target)?;
                println!("node {} joined", a.id);
                print!("{}", render(&status));
            }
            ClusterCommand::Leave(a) => {
                let req = v1::LeaveRequest { node_id: a.id, removed_notice: false, membership_index: 0 };
                let status =
                    answer(client(&a.target).await?.leave(authed(&a.target, req)?).await, "Cluster.Leave", &a.target)?;
                println!("node {} left", a.id);
                print!("{}", render(&status));
            }
            ClusterCommand::Status(a) => {
                let s = answer(
                    client(&a.target).await?.status(authed(&a.target, v1::ClusterStatusRequest {})?).await,
                    "Cluster.Status",
                    &a.target,
                )?;
                if a.json {
                    println!("{}", serde_json::to_string_pretty(&s)?);
                } else {
                    print!("{}", render(&s));
                }
            }
            ClusterCommand::Fault(a) => {
                let req = v1::FaultRequest { isolate: a.isolate, gossip_drop: a.gossip_drop };
                answer(
                    client(&a.target).await?.inject_fault(authed(&a.target, req)?).await,
                    "Cluster.InjectFault",
                    &a.target,
                )?;
                println!("fault set: isolate={} gossip_drop={}", a.isolate, a.gossip_drop);
            }
        }
        anyhow::Ok(())
    })
}

/// A `Cluster` call's answer; a node that runs without `[cluster]` does not serve the service
/// at all, and says so in words instead of gRPC's "unimplemented".
fn answer<T>(r: Result<tonic::Response<T>, tonic::Status>, call: &str, t: &ClusterTarget) -> anyhow::Result<T> {
    match r {
        Ok(r) => Ok(r.into_inner()),
        Err(s) if s.code() == tonic::Code::Unimplemented => anyhow::bail!(
            "{call}: this node runs without [cluster] (a single router node): there is no Raft cluster here; \
             see README.md, \"Running a cluster of router nodes\""
        ),
        // The node's message says what happened; gRPC's status dump around it does not.
        Err(s) => Err(failed(call, &s, t)),
    }
}

/// A failed call to the node at `t` in words, with the token and address hints
/// ([`crate::connect::explain`]).
pub fn failed(call: &str, s: &tonic::Status, t: &ClusterTarget) -> anyhow::Error {
    crate::connect::explain(call, s, &token_source(t.token_file.as_deref()))
}

/// The admin token: `--token-file` when given (a flag beats the environment), else
/// KVMESH_ADMIN_TOKEN, else none.
pub fn admin_token(file: Option<&std::path::Path>) -> anyhow::Result<Option<kvmesh_node::auth::Secret>> {
    match file {
        Some(f) => kvmesh_node::auth::load_file(f).map(Some),
        None => kvmesh_node::auth::load(kvmesh_node::auth::ADMIN_TOKEN_ENV, &None),
    }
}

/// Where [`admin_token`] takes the token from, for error messages.
fn token_source(file: Option<&std::path::Path>) -> String {
    match file {
        Some(f) => format!("from --token-file {}", f.display()),
        None if std::env::var_os(kvmesh_node::auth::ADMIN_TOKEN_ENV).is_some() => {
            format!("from {}", kvmesh_node::auth::ADMIN_TOKEN_ENV)
        }
        None => "none sent".into(),
    }
}

/// `msg` as a request carrying the admin token, if one is given.
pub fn authed<T>(t: &ClusterTarget, msg: T) -> anyhow::Result<tonic::Request<T>> {
    Ok(with_token(&admin_token(t.token_file.as_deref())?, msg))
}

/// `msg` with the admin token, when there is one.
pub fn with_token<T>(token: &Option<kvmesh_node::auth::Secret>, msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    if let Some(t) = token {
        t.attach(r.metadata_mut());
    }
    r
}

async fn client(t: &ClusterTarget) -> anyhow::Result<v1::cluster_client::ClusterClient<tonic::transport::Channel>> {
    let channel = crate::connect::channel(&t.grpc, "is `kvmesh node` running with a [cluster] section?").await?;
    Ok(v1::cluster_client::ClusterClient::new(channel))
}

/// The status as a terminal table.
pub fn render(s: &v1::ClusterStatus) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let leader = s.leader_id.map_or("none".to_string(), |l| format!("{l} ({})", s.leader_addr));
    let _ = writeln!(
        out,
        "node {} is {} · leader {} · term {} · applied {} / log {}{}",
        s.node_id,
        // openraft calls a node that has no membership yet a learner.
        if s.initialized { s.state.as_str() } else { "in no cluster yet" },
        leader,
        s.term,
        s.last_applied,
        s.last_log_index,
        match (s.initialized, s.seeded) {
            (true, true) => "",
            (true, false) => " · registry NOT SEEDED (run `kvmesh cluster init` again)",
            _ => " · NOT INITIALIZED (run `kvmesh cluster init`)",
        }
    );
    let mut members = crate::table::plain(&["node", "addr", "role", "lag", "bookings", "gossip"], &[0, 3, 4, 5]);
    for m in &s.members {
        members.add_row(vec![
            m.node_id.to_string(),
            m.addr.clone(),
            m.role.clone(),
            m.lag.map_or("-".into(), |l| l.to_string()),
            m.shared_bookings.to_string(),
            m.gossip_age_s.map_or("-".into(), |a| format!("{:.1}s ago", a)),
        ]);
    }
    let _ = writeln!(out, "{}", crate::table::lines(&members));
    if !s.registry.is_empty() {
        let params: Vec<String> = {
            let mut p: Vec<(&String, &f64)> = s.policy_params.iter().collect();
            p.sort_by(|a, b| a.0.cmp(b.0));
            p.into_iter().map(|(k, v)| format!("{k}={v}")).collect()
        };
        let policy = match (s.policy.is_empty(), params.is_empty()) {
            (true, _) => "per node".to_string(),
            (false, true) => s.policy.clone(),
            (false, false) => format!("{} {}", s.policy, params.join(" ")),
        };
        let _ = writeln!(out, "registry (policy {policy}):");
        for e in &s.registry {
            let spec = e.spec.clone().unwrap_or_default();
            let _ = writeln!(out, "  {:<16} {:<10} {}", spec.name, e.state, spec.http_endpoint);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> ClusterTarget {
        ClusterTarget { grpc: "http://127.0.0.1:50051".into(), token_file: Some("admin.token".into()) }
    }

    #[test]
    fn a_single_node_says_it_has_no_cluster_in_words() {
        let single = answer::<()>(Err(tonic::Status::unimplemented("")), "Cluster.Status", &target()).unwrap_err();
        assert_eq!(
            single.to_string(),
            "Cluster.Status: this node runs without [cluster] (a single router node): there is no Raft cluster here; \
             see README.md, \"Running a cluster of router nodes\""
        );
        let other =
            answer::<()>(Err(tonic::Status::unavailable("leader unknown")), "Cluster.Join", &target()).unwrap_err();
        assert_eq!(format!("{other:#}").split(": ").next(), Some("Cluster.Join"));
        assert!(format!("{other:#}").contains("leader unknown"), "{other:#}");
    }

    #[test]
    fn status_renders_leader_members_and_registry() {
        let s = v1::ClusterStatus {
            node_id: 2,
            state: "follower".into(),
            leader_id: Some(1),
            leader_addr: "10.0.0.1:50051".into(),
            term: 3,
            last_applied: 12,
            last_log_index: 12,
            members: vec![v1::ClusterMember {
                node_id: 1,
                addr: "10.0.0.1:50051".into(),
                role: "voter".into(),
                lag: None,
                shared_bookings: 4,
                gossip_age_s: Some(0.02),
            }],
            initialized: true,
            seeded: true,
            policy: "token_load".into(),
            policy_params: Default::default(),
            membership_index: 9,
            registry: vec![v1::RegistryEntry {
                spec: Some(v1::ReplicaSpec {
                    name: "vllm-0".into(),
                    http_endpoint: "http://a:8000".into(),
                    ..Default::default()
                }),
                state: "draining".into(),
            }],
        };
        assert_eq!(
            render(&s),
            "node 2 is follower · leader 1 (10.0.0.1:50051) · term 3 · applied 12 / log 12\n\
             \x20node  addr            role   lag  bookings    gossip\n\
             \x20   1  10.0.0.1:50051  voter    -         4  0.0s ago\n\
             registry (policy token_load):\n\
             \x20 vllm-0           draining   http://a:8000\n"
        );
    }
}
