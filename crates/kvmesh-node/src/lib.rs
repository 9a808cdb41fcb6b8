//! kvmesh-node: the router daemon (`kvmesh node --config kvmesh.toml`).
//!
//! - [`config`]: the TOML file.
//! - [`state`]: the routing core (kvmesh-core's `Fleet` and policy) and the replica registry.
//! - [`replica`]: one ractor actor per engine replica (KV events over ZMQ with replay,
//!   metrics scraping, health) under a restarting supervisor.
//! - [`proxy`]: the OpenAI-compatible HTTP proxy, `/health`, `/metrics`.
//! - [`grpc`]: `kvmesh.v1` Router, Admin and Events services, gRPC health and reflection.
//! - [`metrics`]: Prometheus metrics.
//! - [`telemetry`]: logs (text or JSON) and OpenTelemetry OTLP trace export.
//! - [`tokenize`]: prompt text → token ids (the model's tokenizer, or kvmesh's approximate ids).
//! - [`auth`]: bearer tokens for the admin and cluster-internal gRPC (`[security]`).
//! - [`cluster`]: with a `[cluster]` section, Raft (openraft + sled) for membership, the
//!   replica registry and configuration, and gossip for shared bookings.
//!
//! A single node is complete on its own; a cluster of 3 or 5 adds availability and shared
//! load without putting Raft on the request path.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod admission;
pub mod admit;
pub mod auth;
pub mod autoscaler;
pub mod body_budget;
pub mod booking_token;
pub mod cluster;
pub mod config;
pub mod disaggregated;
pub mod endpoints;
pub mod epp;
pub mod errors;
pub mod grpc;
pub mod health;
pub mod http_server;
pub mod in_flight;
pub mod metrics;
pub mod metrics_page;
pub mod metrics_text;
pub mod models;
pub(crate) mod openai_error;
pub mod preflight;
pub mod proxy;
pub mod proxy_runtime;
pub mod replica;
pub mod replication;
pub mod request;
pub mod response;
pub mod state;
pub mod tasks;
pub mod telemetry;
pub mod tls;
pub mod tokenize;

use anyhow::Context;
use config::NodeConfig;
use kvmesh_proto::v1::{admin_server::AdminServer, events_server::EventsServer, router_server::RouterServer};
use ractor::{Actor, ActorRef};
use replica::{Supervisor, SupervisorMsg};
use state::Shared;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::watch;

/// A running node.
pub struct Node {
    /// The bound HTTP address.
    pub http: SocketAddr,
    /// The bound gRPC address.
    pub grpc: SocketAddr,
    /// Its state (tests and the CLI read it).
    pub shared: Arc<Shared>,
    /// Its replica supervisor.
    pub supervisor: ActorRef<SupervisorMsg>,
    /// Its cluster membership, when configured.
    pub cluster: Option<Arc<cluster::Cluster>>,
    stop: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Node {
    /// Adds a replica at runtime.
    ///
    /// # Errors
    /// The name is taken or a field is invalid.
    pub async fn add_replica(&self, config: config::ReplicaConfig) -> anyhow::Result<()> {
        ractor::call!(self.supervisor, SupervisorMsg::Add, Box::new(config))
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .map_err(anyhow::Error::from)
    }

    /// Removes a replica at runtime.
    ///
    /// # Errors
    /// Unknown replica.
    pub async fn remove_replica(&self, name: &str) -> anyhow::Result<()> {
        ractor::call!(self.supervisor, SupervisorMsg::Remove, name.to_string())
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .map_err(anyhow::Error::from)
    }

    /// Brings the replica set in line with `config.replicas` (a config reload): removes
    /// replicas no longer listed, adds new ones, restarts changed ones, and puts back in
    /// rotation the listed ones the admin API drained (on a single node the file is the
    /// registry), not those the autoscaler drained to release. Other sections take effect on restart only; a changed one is logged as such.
    ///
    /// # Errors
    /// The first replica that could not be added.
    pub async fn reload(&self, config: &NodeConfig) -> anyhow::Result<()> {
        config.validate()?;
        if self.cluster.as_ref().is_some_and(|c| c.state.borrow().seeded) {
            anyhow::bail!(
                "this node follows the cluster's replica registry; change replicas with `kvmesh replica \
                 add|remove|drain|undrain` (the Admin API), not the config file"
            );
        }
        let current: Vec<config::ReplicaConfig> =
            self.shared.core().replicas.values().map(|r| r.config.clone()).collect();
        for old in &current {
            if !config.replicas.contains(old) {
                self.remove_replica(&old.name).await?;
            }
        }
        for new in &config.replicas {
            if !current.contains(new) {
                self.add_replica(new.clone()).await?;
            }
        }
        // Not the autoscaler's drains (`drain_on_scale_down`): those replicas are on their
        // way out, and the actuator releases them.
        let released: std::collections::HashSet<String> =
            self.shared.autoscaler.all().iter().flat_map(|d| d.drain.iter().cloned()).collect();
        for r in config.replicas.iter().filter(|r| !released.contains(&r.name)) {
            let drained = self.shared.core().replicas.get(&r.name).is_some_and(|x| x.draining());
            if drained && self.shared.set_draining(&r.name, false).is_ok() {
                tracing::info!(replica = %r.name, "reload: back in rotation (drained through the admin API)");
            }
        }
        let changed = config::sections_changed(&self.shared.config.lock().unwrap_or_else(|p| p.into_inner()), config);
        if !changed.is_empty() {
            tracing::warn!(
                sections = %changed.join(", "),
                "reload applies [[replicas]] only; restart the node for the changes to these sections"
            );
        }
        Ok(())
    }

    /// Stops serving, stops every replica actor, and waits (5 s at most) for the servers to
    /// end. A cluster member stops Raft first, so the others elect a new leader at once
    /// instead of waiting for this node's long-lived streams to close.
    pub async fn stop(self) {
        self.drain().await;
        let _ = self.stop.send(true);
        if let Some(c) = &self.cluster {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(2), c.raft.shutdown()).await;
        }
        let _ = self.supervisor.stop_and_wait(None, Some(std::time::Duration::from_secs(5))).await;
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        for mut t in self.tasks {
            if tokio::time::timeout_at(deadline, &mut t).await.is_err() {
                t.abort();
            }
        }
    }
}

impl Node {
    /// The first half of [`Node::stop`]: reports not ready at once and waits, at most
    /// `node.shutdown_grace`, for the requests the node follows to finish (new ones are
    /// still served meanwhile: a load balancer takes a moment to see the node go).
    pub async fn drain(&self) {
        use std::sync::atomic::Ordering;
        self.shared.stopping.store(true, Ordering::Release);
        let grace = self.shared.config.lock().unwrap_or_else(|p| p.into_inner()).node.shutdown_grace;
        let deadline = tokio::time::Instant::now() + grace;
        let pending = || self.shared.in_flight.load(Ordering::Acquire);
        if pending() > 0 {
            tracing::info!(
                in_flight = pending(),
                grace_s = grace.as_secs_f64(),
                "stopping: letting requests in flight finish"
            );
        }
        while pending() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        if pending() > 0 {
            tracing::warn!(
                in_flight = pending(),
                grace_s = grace.as_secs_f64(),
                "stopping: grace period over; cutting the rest"
            );
        }
    }
}

/// Starts a node: binds its HTTP and gRPC ports, starts one actor per configured replica.
///
/// # Errors
/// [`preflight::check`]'s refusals, or a port that cannot be bound.
pub async fn start(config: NodeConfig) -> anyhow::Result<Node> {
    let preflight::Preflight { tls, tokenizer, tokens, warnings } = preflight::check(&config)?;
    let replicas = config.replicas.clone();
    let (http_addr, grpc_addr) = (config.node.http, config.node.grpc);
    let mut initial = config.clone();
    initial.replicas.clear();
    let shared = Arc::new(Shared::with_loaded(initial, tokenizer, tokens)?);
    // Ports first: a bind failure must not leave replica actors running.
    let http_listener =
        tokio::net::TcpListener::bind(http_addr).await.with_context(|| format!("binding HTTP {http_addr}"))?;
    let http = http_listener.local_addr()?;
    let grpc_listener =
        tokio::net::TcpListener::bind(grpc_addr).await.with_context(|| format!("binding gRPC {grpc_addr}"))?;
    let grpc = grpc_listener.local_addr()?;
    for warning in warnings {
        tracing::warn!("{warning}");
    }
    let adm = &config.admission;
    if adm.enabled {
        match adm.ttft_slo {
            Some(slo) => tracing::info!(
                queue_limit = adm.queue_limit,
                max_wait_s = adm.max_wait.as_secs_f64(),
                ttft_slo_s = slo.as_secs_f64(),
                "admission control on, with the TTFT gate: requests wait at the router while capacity is short or \
                 the best replica would make them miss the SLO"
            ),
            None => tracing::info!(
                queue_limit = adm.queue_limit,
                max_wait_s = adm.max_wait.as_secs_f64(),
                "admission control on, no TTFT gate (ttft_slo unset): requests wait at the router while capacity \
                 is short"
            ),
        }
    }
    let cluster = match config.cluster.clone() {
        Some(section) => {
            section.check_own_peer(grpc.port())?;
            let default_addr = if grpc.ip().is_unspecified() {
                tracing::warn!("cluster.addr not set and node.grpc binds all interfaces: peers are told 127.0.0.1");
                format!("127.0.0.1:{}", grpc.port())
            } else {
                grpc.to_string()
            };
            let c = cluster::Cluster::start(
                section,
                default_addr,
                replicas.clone(),
                (config.node.policy.clone(), config.node.policy_params.clone()),
                shared.tokens.cluster.clone(),
                tls.as_ref().map(|t| t.client.clone()),
            )
            .await
            .context("starting the cluster member")?;
            let c = Arc::new(c);
            let _ = shared.cluster.set(c.clone());
            Some(c)
        }
        None => None,
    };
    // A node of a seeded cluster follows the registry, not its file.
    let replicas = match &cluster {
        Some(c) if c.state.borrow().seeded => Vec::new(),
        _ => replicas,
    };
    let (supervisor, _) =
        Actor::spawn(None, Supervisor, shared.clone()).await.context("starting the replica supervisor")?;
    for r in replicas {
        let name = r.name.clone();
        let added = ractor::call!(supervisor, SupervisorMsg::Add, Box::new(r))
            .map_err(|e| anyhow::anyhow!("{e}"))
            .and_then(|r| r.map_err(|e| anyhow::anyhow!("replica {name}: {e}")));
        if let Err(e) = added {
            let _ = supervisor.stop_and_wait(None, Some(std::time::Duration::from_secs(5))).await;
            return Err(e);
        }
    }
    let (stop, stopped) = watch::channel(false);
    let mut tasks = Vec::new();
    // Bookings end by themselves after the lease (a gRPC client that never calls Release, a
    // lost proxy task): one sweep a second, which also logs admission refusals not yet logged.
    let (sweeper, mut s0) = (shared.clone(), stopped.clone());
    let peer_timeout_s = config.cluster.as_ref().map_or(5.0, |c| c.peer_timeout.as_secs_f64());
    let lease_s = config.node.booking_lease.as_secs_f64();
    tasks.push(tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    let now = sweeper.now();
                    let expired = sweeper.core().expire(now, peer_timeout_s);
                    if expired > 0 {
                        sweeper.metrics.bookings_expired.inc_by(expired as u64);
                        tracing::warn!(
                            bookings = expired,
                            lease_s,
                            "bookings expired without a release (a Route caller that never called Release, or a \
                             request running longer than node.booking_lease)"
                        );
                        // Their load is off the replicas: as many waiting requests may fit now.
                        for _ in 0..expired {
                            sweeper.admission.capacity_freed();
                        }
                    }
                    sweeper.admission.flush_refusals();
                }
                _ = s0.wait_for(|s| *s) => break,
            }
        }
    }));
    let app = proxy::router(shared.clone());
    let http_tls = tls.as_ref().map(|t| t.http.clone());
    match proxy_runtime::spawn(
        http_listener,
        http_tls,
        app,
        http_server::ServeLimits::from_config(&config.limits),
        config.node.proxy_threads,
        stopped.clone(),
    ) {
        Ok(t) => tasks.push(t),
        Err(e) => {
            let _ = supervisor.stop_and_wait(None, Some(std::time::Duration::from_secs(5))).await;
            return Err(e);
        }
    }
    if let Some(c) = &cluster {
        let section = c.section.clone();
        if section.gossip {
            tasks.push(tokio::spawn(tasks::gossip::run(shared.clone(), c.clone(), section, stopped.clone())));
        }
        tasks.push(tokio::spawn(cluster::log_leadership(c.clone(), stopped.clone())));
        tasks.push(tokio::spawn(cluster::removal::watch(c.clone(), stopped.clone())));
        tasks.push(tokio::spawn(tasks::reconcile::run(
            shared.clone(),
            supervisor.clone(),
            c.state.clone(),
            stopped.clone(),
        )));
    }
    tasks.push(tokio::spawn(tasks::replication::run(shared.clone(), cluster.clone(), stopped.clone())));
    tasks.push(tokio::spawn(tasks::autoscaler::run(shared.clone(), cluster.clone(), stopped.clone())));
    let autoscaler_service = grpc::autoscaler::AutoscalerService { shared: shared.clone() };
    let services = grpc::Services {
        shared: shared.clone(),
        supervisor: supervisor.clone(),
        cluster: cluster.clone(),
        push: Arc::new(replica::push::PushGuards::new(&shared.limits)),
    };
    let replication_service =
        grpc::replication::ReplicationService { shared: shared.clone(), cluster: cluster.clone() };
    let picker = epp::EndpointPicker::new(shared.clone(), config.epp.clone());
    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter.set_serving::<RouterServer<grpc::Services>>().await;
    health_reporter.set_serving::<AdminServer<grpc::Services>>().await;
    health_reporter.set_serving::<EventsServer<grpc::Services>>().await;
    // The endpoint picker protocol's health names: `liveness` while the process answers;
    // `readiness` and the ext_proc service follow the replicas (health::follow_grpc).
    health_reporter.set_service_status("liveness", tonic_health::ServingStatus::Serving).await;
    // Router (and the server as a whole) follow the replicas, as /health does.
    tasks.push(tokio::spawn(health::follow_grpc(shared.clone(), health_reporter.clone(), stopped.clone())));
    // Both reflection versions: grpcurl speaks v1, many clients (grpc-requests, older
    // grpcurl, Postman) only v1alpha.
    let described = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(kvmesh_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection = described().build_v1().context("gRPC reflection")?;
    let reflection_v1alpha = described().build_v1alpha().context("gRPC reflection (v1alpha)")?;
    let mut s2 = stopped;
    // No Nagle: a small gRPC answer held for the client's delayed ACK costs ~40 ms (tonic
    // sets this only on listeners it binds itself).
    let incoming = tokio_stream::StreamExt::map(tokio_stream::wrappers::TcpListenerStream::new(grpc_listener), |s| {
        s.inspect(|s| {
            let _ = s.set_nodelay(true);
        })
    });
    let cluster_services = cluster.as_ref().map(|c| grpc::cluster::ClusterServices {
        cluster: c.clone(),
        shared: shared.clone(),
        stopped: s2.clone(),
    });
    let grpc_tls = tls.as_ref().map(|t| t.grpc.clone());
    let limits = config.limits.clone();
    tasks.push(tokio::spawn(async move {
        use kvmesh_proto::v1::{cluster_server::ClusterServer, gossip_server::GossipServer, raft_server::RaftServer};
        let mut builder = tonic::transport::Server::builder()
            .concurrency_limit_per_connection(limits.grpc_concurrency_per_connection);
        let public = limits.grpc_public_max_message_bytes;
        let epp_max = limits.http_max_body_bytes + (1 << 20);
        let cluster_max = cluster::MAX_MESSAGE_BYTES;
        if let Some(t) = grpc_tls {
            builder = match builder.tls_config(t) {
                Ok(b) => b,
                Err(e) => {
                    tracing::error!(error = %e, "gRPC TLS configuration");
                    return;
                }
            };
        }
        let result = builder
            .add_service(health)
            .add_service(reflection)
            .add_service(reflection_v1alpha)
            .add_service(
                RouterServer::new(services.clone()).max_decoding_message_size(public).max_encoding_message_size(public),
            )
            .add_service(
                // Its calls' credentials go with the writes they forward (cluster::operator).
                cluster::operator::Scoped(
                    AdminServer::new(services.clone())
                        .max_decoding_message_size(public)
                        .max_encoding_message_size(public),
                ),
            )
            .add_service(
                EventsServer::new(services).max_decoding_message_size(public).max_encoding_message_size(public),
            )
            .add_service(
                // A buffered-mode gateway sends the whole body in one message.
                envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer::new(
                    picker,
                )
                .max_decoding_message_size(public.max(epp_max))
                .max_encoding_message_size(public),
            )
            .add_service(
                kvmesh_proto::v1::replication_server::ReplicationServer::new(replication_service)
                    .max_decoding_message_size(public)
                    .max_encoding_message_size(public),
            )
            .add_service(
                kvmesh_proto::v1::autoscaler_server::AutoscalerServer::new(autoscaler_service.clone())
                    .max_decoding_message_size(public)
                    .max_encoding_message_size(public),
            )
            .add_service(
                kvmesh_proto::externalscaler::external_scaler_server::ExternalScalerServer::new(autoscaler_service)
                    .max_decoding_message_size(public)
                    .max_encoding_message_size(public),
            )
            // Raft and gossip check the nodes' token before a message is read (an interceptor
            // sees the metadata only), so a stranger cannot make the node buffer 64 MiB.
            .add_optional_service(cluster_services.clone().map(|s| {
                let token = s.cluster.token.clone();
                tonic::service::interceptor::InterceptedService::new(
                    RaftServer::new(s).max_decoding_message_size(cluster_max).max_encoding_message_size(cluster_max),
                    move |r: tonic::Request<()>| auth::check(r.metadata(), &[&token]).map(|_| r),
                )
            }))
            .add_optional_service(cluster_services.clone().map(|s| {
                cluster::operator::Scoped(
                    ClusterServer::new(s).max_decoding_message_size(public).max_encoding_message_size(public),
                )
            }))
            .add_optional_service(cluster_services.map(|s| {
                let token = s.cluster.token.clone();
                tonic::service::interceptor::InterceptedService::new(
                    GossipServer::new(s).max_decoding_message_size(cluster_max).max_encoding_message_size(cluster_max),
                    move |r: tonic::Request<()>| auth::check(r.metadata(), &[&token]).map(|_| r),
                )
            }))
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = s2.wait_for(|s| *s).await;
            })
            .await;
        if let Err(e) = result {
            tracing::error!(error = %e, "gRPC server ended");
        }
    }));
    tracing::info!(%http, %grpc, "kvmesh node serving");
    Ok(Node { http, grpc, shared, supervisor, cluster, stop, tasks })
}
