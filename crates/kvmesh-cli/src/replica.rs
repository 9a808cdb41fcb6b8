//! `kvmesh replica add|remove|drain|undrain|starting|ready`: a node's admin API
//! (`kvmesh.v1.Admin`) from the shell, including the waits an engine pod's start-up script and
//! preStop hook need (`ready --wait`, `drain --wait`).

use crate::cli::{ClusterTarget, ReplicaCommand};
use crate::cluster::{authed, failed as fail};
use kvmesh_proto::v1;

pub fn run(cmd: &ReplicaCommand) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        match cmd {
            ReplicaCommand::Add(a) => {
                let spec = v1::ReplicaSpec {
                    name: a.name.clone(),
                    http_endpoint: a.http.clone(),
                    kv_events_endpoint: a.kv_events.clone().unwrap_or_default(),
                    replay_endpoint: a.replay.clone().unwrap_or_default(),
                    capacity_blocks: a.capacity_blocks,
                    model: a.model.clone().unwrap_or_default(),
                    data_parallel_rank: a.data_parallel_rank,
                    lora_adapters: a.lora_adapters.clone(),
                    role: if a.role == "both" { String::new() } else { a.role.clone() },
                    engine: a.engine.clone(),
                    bootstrap_port: a.bootstrap_port.map(u32::from),
                    ..Default::default()
                };
                let mut client = admin(&a.target).await?;
                let request = v1::AddReplicaRequest { spec: Some(spec.clone()), starting: a.starting };
                let answer = client.add_replica(authed(&a.target, request)?).await;
                if let Some(w) =
                    answer.as_ref().ok().and_then(|r| r.metadata().get(kvmesh_node::grpc::ADD_REPLICA_WARNING))
                {
                    eprintln!("warning: {}", w.to_str().unwrap_or("(not text)"));
                }
                match answer {
                    // An older node ignores `starting` and registers it ready.
                    Ok(r) if a.starting && r.get_ref().status != v1::ReplicaStatus::Starting as i32 => {
                        anyhow::bail!(
                            "replica {} was added ready, not starting: the node predates `add --starting` (upgrade \
                             every node); `kvmesh replica starting --name {}` marks it now",
                            a.name,
                            a.name
                        )
                    }
                    Ok(_) if a.starting => {
                        println!("replica {} added, starting: not routed to, counted by the autoscaler", a.name)
                    }
                    Ok(_) if a.capacity_blocks == 0 => println!(
                        "replica {} added; starting until its engine reports its KV capacity (num_gpu_blocks on its \
                         metrics page)",
                        a.name
                    ),
                    Ok(_) => println!("replica {} added", a.name),
                    Err(e) if e.code() == tonic::Code::AlreadyExists => {
                        // A retry (or a restarted start-up script): the same registration is done.
                        let list = client.list_replicas(authed(&a.target, v1::ListReplicasRequest {})?).await?;
                        let key = |s: &v1::ReplicaSpec, from_engine: bool| {
                            (
                                s.name.clone(),
                                s.http_endpoint.clone(),
                                s.kv_events_endpoint.clone(),
                                s.replay_endpoint.clone(),
                                // As registered: left out (0), a listing shows the engine's figure.
                                if from_engine { 0 } else { s.capacity_blocks },
                                s.model.clone(),
                                s.data_parallel_rank,
                                s.role.clone(),
                            )
                        };
                        let same = list
                            .into_inner()
                            .replicas
                            .into_iter()
                            .filter_map(|r| r.spec.map(|s| (s, r.capacity_from_engine)))
                            .any(|(s, from_engine)| key(&s, from_engine) == key(&spec, false));
                        anyhow::ensure!(
                            same,
                            "Admin.AddReplica: {} (with other endpoints, capacity, model or rank)",
                            e.message()
                        );
                        println!("replica {} already registered with these endpoints: unchanged", a.name);
                        return Ok(());
                    }
                    Err(e) => return Err(fail("Admin.AddReplica", &e, &a.target)),
                }
            }
            ReplicaCommand::Remove(a) => remove(&mut admin(&a.target).await?, a).await?,
            ReplicaCommand::Drain(d) => {
                let a = &d.replica;
                if d.wait {
                    positive_seconds(d.timeout)?;
                }
                let mut client = admin(&a.target).await?;
                drain(&mut client, a, if d.wait { d.timeout } else { 10.0 }).await?;
                println!("replica {} draining", a.name());
                warn_if_none_routable(&mut client, &a.target).await;
                if d.wait && wait_idle(&mut client, a, d.timeout).await? && d.remove {
                    remove(&mut client, a).await?;
                }
            }
            ReplicaCommand::Undrain(a) => {
                admin(&a.target)
                    .await?
                    .undrain_replica(authed(&a.target, v1::ReplicaRef { name: a.name().to_string() })?)
                    .await
                    .map_err(|s| fail("Admin.UndrainReplica", &s, &a.target))?;
                println!("replica {} back in rotation", a.name());
            }
            ReplicaCommand::Ready(r) => {
                let a = &r.replica;
                let mut client = admin(&a.target).await?;
                if r.wait {
                    positive_seconds(r.timeout)?;
                    let wait = Wait { not_yet: "engine does not answer", stays: "it stays starting" };
                    let found = wait_for(&mut client, a, r.timeout, wait, |r| Ok(r.engine_up)).await?;
                    anyhow::ensure!(found.is_some(), "replica {} is not registered (removed while waiting)", a.name());
                }
                client.mark_ready(authed(&a.target, v1::ReplicaRef { name: a.name().to_string() })?).await.map_err(
                    |s| match s.code() {
                        tonic::Code::Unimplemented => {
                            anyhow::anyhow!("Admin.MarkReady: the node does not know this call")
                        }
                        _ => fail("Admin.MarkReady", &s, &a.target),
                    },
                )?;
                println!("replica {} ready: in rotation", a.name());
            }
            ReplicaCommand::Starting(a) => {
                admin(&a.target)
                    .await?
                    .mark_starting(authed(&a.target, v1::ReplicaRef { name: a.name().to_string() })?)
                    .await
                    .map_err(|s| fail("Admin.MarkStarting", &s, &a.target))?;
                println!("replica {} starting: not routed to, counted by the autoscaler", a.name());
                warn_if_none_routable(&mut admin(&a.target).await?, &a.target).await;
            }
        }
        anyhow::Ok(())
    })
}

/// Removes `a.name()`; one already gone (a retried hook, or `drain --wait --remove` before) is
/// done too.
async fn remove(
    client: &mut v1::admin_client::AdminClient<tonic::transport::Channel>,
    a: &crate::cli::ReplicaNameArgs,
) -> anyhow::Result<()> {
    match client.remove_replica(authed(&a.target, v1::ReplicaRef { name: a.name().to_string() })?).await {
        Ok(_) => println!("replica {} removed", a.name()),
        Err(e) if e.code() == tonic::Code::NotFound => {
            println!("replica {} is not registered: nothing to remove", a.name())
        }
        Err(e) => return Err(fail("Admin.RemoveReplica", &e, &a.target)),
    }
    Ok(())
}

/// A `--timeout` that a wait can run to.
fn positive_seconds(timeout: f64) -> anyhow::Result<()> {
    anyhow::ensure!(
        timeout.is_finite() && timeout > 0.0,
        "--timeout must be a positive number of seconds, got {timeout}"
    );
    Ok(())
}

/// Warns when no replica takes traffic any more (the last one was drained): every request
/// now gets 503.
async fn warn_if_none_routable(
    client: &mut v1::admin_client::AdminClient<tonic::transport::Channel>,
    target: &ClusterTarget,
) {
    let Ok(req) = authed(target, v1::ListReplicasRequest {}) else { return };
    let Ok(list) = client.list_replicas(req).await else { return };
    let replicas = list.into_inner().replicas;
    // Routable as the node decides it (`ReplicaStatus::routable`); a status this build does
    // not know (a newer node) counts as taking traffic, so no false alarm.
    let takes_traffic =
        |r: &v1::Replica| kvmesh_proto::convert::replica_status(r.status).map_or(true, |s| s.routable());
    if !replicas.iter().any(takes_traffic) {
        eprintln!(
            "warning: no replica takes traffic now: every request gets 503 until one is back \
             (`kvmesh replica undrain --name <replica>`)"
        );
    }
}

/// Asks the node to drain `a.name()`, again while it does not answer or has no Raft leader (a
/// router restarting or electing), for up to `patience_s` seconds.
async fn drain(
    client: &mut v1::admin_client::AdminClient<tonic::transport::Channel>,
    a: &crate::cli::ReplicaNameArgs,
    patience_s: f64,
) -> anyhow::Result<()> {
    let began = std::time::Instant::now();
    loop {
        let ask = client.drain_replica(authed(&a.target, v1::ReplicaRef { name: a.name().to_string() })?);
        let err = match tokio::time::timeout(std::time::Duration::from_secs(10), ask).await {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) if !matches!(e.code(), tonic::Code::Unavailable | tonic::Code::DeadlineExceeded) => {
                return Err(fail("Admin.DrainReplica", &e, &a.target))
            }
            Ok(Err(e)) => format!("{:?}: {}", e.code(), e.message()),
            Err(_) => "no answer within 10 s".to_string(),
        };
        if began.elapsed().as_secs_f64() >= patience_s {
            anyhow::bail!("Admin.DrainReplica: {err}; gave up after {patience_s} s");
        }
        println!("replica {}: drain not accepted yet ({err}); asking again", a.name());
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

/// `drain --wait` or `ready --wait` gave up: exit code 124 (as timeout(1)), so a hook can tell
/// it from a mistake (exit 1) or a usage error (exit 2).
#[derive(Debug)]
pub struct TimedOut(String);

impl std::fmt::Display for TimedOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TimedOut {}

/// Polls the node until replica `a.name()` is idle, printing what is left whenever it changes;
/// returns whether it is still registered.
async fn wait_idle(
    client: &mut v1::admin_client::AdminClient<tonic::transport::Channel>,
    a: &crate::cli::ReplicaNameArgs,
    timeout_s: f64,
) -> anyhow::Result<bool> {
    let began = std::time::Instant::now();
    let draining = v1::ReplicaStatus::Draining as i32;
    let wait = Wait { not_yet: "not idle", stays: "it stays draining and registered" };
    let found = wait_for(client, a, timeout_s, wait, |r| {
        if r.idle {
            return Ok(true);
        }
        if r.status != draining {
            anyhow::bail!("replica {} was put back into rotation while waiting", a.name());
        }
        Ok(false)
    })
    .await?;
    if found.is_none() {
        println!("replica {} is no longer registered: nothing routes to it", a.name());
        return Ok(false);
    }
    println!("replica {} idle after {:.1} s: safe to release", a.name(), began.elapsed().as_secs_f64());
    Ok(true)
}

/// What a wait says when it gives up: "replica X {not_yet} after T s (…); {stays}".
struct Wait {
    not_yet: &'static str,
    stays: &'static str,
}

/// Polls the node until `done` holds for replica `a.name()`, printing its status detail
/// whenever it changes; returns it then, or `None` once it is no longer registered. `done`'s
/// error ends the wait. A node that does not answer (restarting, electing a leader) is asked
/// again until the timeout ([`TimedOut`]).
async fn wait_for(
    client: &mut v1::admin_client::AdminClient<tonic::transport::Channel>,
    a: &crate::cli::ReplicaNameArgs,
    timeout_s: f64,
    wait: Wait,
    done: impl Fn(&v1::Replica) -> anyhow::Result<bool>,
) -> anyhow::Result<Option<v1::Replica>> {
    let began = std::time::Instant::now();
    let mut said = String::new();
    loop {
        let ask = client.list_replicas(authed(&a.target, v1::ListReplicasRequest {})?);
        let now = match tokio::time::timeout(std::time::Duration::from_secs(5), ask).await {
            Ok(Ok(list)) => {
                let found = list
                    .into_inner()
                    .replicas
                    .into_iter()
                    .find(|r| r.spec.as_ref().is_some_and(|s| s.name == a.name()));
                let Some(r) = found else { return Ok(None) };
                if done(&r)? {
                    return Ok(Some(r));
                }
                r.status_detail
            }
            Ok(Err(e)) if e.code() == tonic::Code::Unauthenticated || e.code() == tonic::Code::PermissionDenied => {
                return Err(fail("Admin.ListReplicas", &e, &a.target));
            }
            Ok(Err(e)) => format!("the node answered {:?}: {}; asking again", e.code(), e.message()),
            Err(_) => "the node did not answer within 5 s; asking again".to_string(),
        };
        if now != said {
            println!("replica {}: {now}", a.name());
            said = now;
        }
        if began.elapsed().as_secs_f64() >= timeout_s {
            let Wait { not_yet, stays } = wait;
            return Err(
                TimedOut(format!("replica {} {not_yet} after {timeout_s} s ({said}); {stays}", a.name())).into()
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}

async fn admin(t: &ClusterTarget) -> anyhow::Result<v1::admin_client::AdminClient<tonic::transport::Channel>> {
    let channel = crate::connect::channel(&t.grpc, crate::connect::NODE_HINT).await?;
    Ok(v1::admin_client::AdminClient::new(channel))
}
