//! The node's configuration file (`kvmesh node --config kvmesh.toml`).
//!
//! ```toml
//! [node]
//! http = "0.0.0.0:8080"          # OpenAI-compatible proxy, /health, /metrics
//! grpc = "0.0.0.0:50051"         # kvmesh.v1 Router/Admin/Events, health, reflection
//! policy = "token_load"          # see `kvmesh policies`
//! block_size = 16                # tokens per KV block; must equal the engines' --block-size
//! model = "meta-llama/Llama-3.1-8B-Instruct"
//! tokenizer = "/models/llama-3.1-8b/tokenizer.json"   # optional: exact token ids
//!
//! [[replicas]]
//! name = "vllm-0"
//! http = "http://10.0.0.7:8000"
//! kv_events = "tcp://10.0.0.7:5557"   # vLLM --kv-events-config endpoint; omit: no events
//! replay = "tcp://10.0.0.7:5558"      # vLLM replay_endpoint; omit: resync by clearing
//! capacity_blocks = 29375             # vLLM logs "GPU KV cache size: N tokens"; N / block_size
//!
//! [cluster]                 # optional: run as one of 3 or 5 router nodes (Raft + gossip)
//! id = 1                    # this node's id, > 0, unique in the cluster
//! addr = "10.0.1.1:50051"   # its gRPC address as peers reach it (default: node.grpc)
//! peers = ["1=10.0.1.1:50051", "2=10.0.1.2:50051", "3=10.0.1.3:50051"]   # initial voters
//! data_dir = "/var/lib/kvmesh"   # Raft log and state machine (sled)
//! ```
//!
//! In a cluster the `[[replicas]]` list seeds the replicated registry at `kvmesh cluster init`;
//! from then on the registry (admin API, through the Raft leader) is what every node follows.

use kvmesh_core::{PolicyKind, Role};
use serde::{Deserialize, Serialize};
use std::path::Path;

mod admission;
mod autoscaler;
mod cluster;
mod epp;
mod error;
mod hints;
mod limits;
mod node;
mod replica;
mod replication;
mod spec;
mod split;
pub use admission::AdmissionSection;
pub use autoscaler::AutoscalerSection;
pub use cluster::ClusterSection;
pub use epp::EppSection;
pub use error::ConfigError;
pub use limits::LimitsSection;
pub use node::NodeSection;
pub use replica::{ReplicaConfig, DEFAULT_BOOTSTRAP_PORT, MAX_DATA_PARALLEL_SIZE};
pub use replication::ReplicationSection;

/// Everything a node runs with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// Node-wide settings (every key has a default, so the section may be left out).
    #[serde(default)]
    pub node: NodeSection,
    /// The engine replicas to route to.
    #[serde(default)]
    pub replicas: Vec<ReplicaConfig>,
    /// Cluster membership; absent: a single node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<ClusterSection>,
    /// Bearer tokens for the admin and cluster-internal gRPC; absent: open.
    #[serde(default, skip_serializing_if = "is_default")]
    pub security: crate::auth::SecuritySection,
    /// Hot-prefix detection and partial KV replication; off unless `enabled`.
    #[serde(default)]
    pub replication: ReplicationSection,
    /// The tier's autoscaler; off unless `enabled`.
    #[serde(default)]
    pub autoscaler: AutoscalerSection,
    /// Admission control while capacity is short; off unless `enabled`.
    #[serde(default)]
    pub admission: AdmissionSection,
    /// Caps on what one replica, client or peer may cost the node.
    #[serde(default)]
    pub limits: LimitsSection,
    /// The Gateway API Inference Extension endpoint picker (Envoy ext_proc on the gRPC port).
    #[serde(default)]
    pub epp: EppSection,
}

/// The sections other than `[[replicas]]` that differ between `running` and `file` (what a
/// reload does not apply), by their TOML names.
pub fn sections_changed(running: &NodeConfig, file: &NodeConfig) -> Vec<&'static str> {
    let NodeConfig { node, replicas: _, cluster, security, replication, autoscaler, admission, limits, epp } = file;
    [
        ("[node]", running.node != *node),
        ("[cluster]", running.cluster != *cluster),
        ("[security]", running.security != *security),
        ("[replication]", running.replication != *replication),
        ("[autoscaler]", running.autoscaler != *autoscaler),
        ("[admission]", running.admission != *admission),
        ("[limits]", running.limits != *limits),
        ("[epp]", running.epp != *epp),
    ]
    .into_iter()
    .filter_map(|(name, changed)| changed.then_some(name))
    .collect()
}

/// `d` as configured, e.g. `1s 500ms` (humantime's form, which the file takes too).
pub fn human(d: std::time::Duration) -> String {
    humantime_serde::re::humantime::format_duration(d).to_string()
}

/// The longest duration a setting takes.
const DAY: std::time::Duration = std::time::Duration::from_secs(86_400);

/// Checks a duration is at most a day, and positive unless `zero_ok` (where 0 means something).
///
/// # Errors
/// [`ConfigError::Setting`] naming `key`.
pub(crate) fn up_to_a_day(key: &str, d: std::time::Duration, zero_ok: bool) -> Result<(), ConfigError> {
    if d > DAY || (d.is_zero() && !zero_ok) {
        let positive = if zero_ok { "" } else { "positive and " };
        return Err(ConfigError::setting(
            key,
            format!("must be {positive}at most a day (\"24h\"), got \"{}\"", human(d)),
        ));
    }
    Ok(())
}

fn is_default(s: &crate::auth::SecuritySection) -> bool {
    *s == crate::auth::SecuritySection::default()
}

impl NodeConfig {
    /// Replaces every entry with a `data_parallel_size` by its ranks
    /// ([`ReplicaConfig::ranks`]), in place.
    ///
    /// # Errors
    /// As [`ReplicaConfig::ranks`].
    pub fn expand_data_parallel(&mut self) -> Result<(), ConfigError> {
        let mut out = Vec::with_capacity(self.replicas.len());
        for r in &self.replicas {
            out.extend(r.ranks()?);
        }
        self.replicas = out;
        Ok(())
    }

    /// Reads and validates a TOML file.
    ///
    /// # Errors
    /// The file cannot be read, is not valid TOML for this schema (with the line), or fails
    /// [`NodeConfig::validate`].
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let config = Self::read(path)?;
        config.validate().map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Ok(config)
    }

    /// Reads a TOML file without validating it (command-line flags complete it first).
    ///
    /// # Errors
    /// The file cannot be read or is not valid TOML for this schema (with the line).
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
        Self::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
    }

    /// Reads TOML text without validating it; data-parallel entries expanded.
    ///
    /// # Errors
    /// [`ConfigError::Syntax`]: not valid TOML for this schema (the message names the line and,
    /// for common mistakes, ends with a `hint:` line saying what to write); or
    /// [`ConfigError::Replica`] from [`NodeConfig::expand_data_parallel`].
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let mut config: NodeConfig = toml::from_str(text).map_err(|e| ConfigError::Syntax {
            message: e.to_string().trim_end().to_string(),
            hint: hints::hint(&e, text),
        })?;
        config.expand_data_parallel()?;
        Ok(config)
    }

    /// Valid but probably not meant: each a line for the start-up log.
    pub fn doubts(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.replicas.is_empty() && self.cluster.is_none() {
            out.push(
                "no [[replicas]] configured: the node routes nothing until replicas are added (`kvmesh replica add`, \
                 or [[replicas]] in this file and SIGHUP)"
                    .into(),
            );
        }
        let wanted = self
            .node
            .policy
            .parse::<PolicyKind>()
            .ok()
            .and_then(|k| k.build_with(&self.node.params()).ok())
            .and_then(|p| p.scrape_interval_s().map(|s| (p.name(), s)));
        if let Some((policy, s)) = wanted {
            let theirs = human(std::time::Duration::from_secs_f64(s));
            if self.node.scrape_interval.as_secs_f64() > s {
                out.push(format!(
                    "policy {policy} reproduces a router that reads engine metrics every {theirs}; node.scrape_interval \
                     is {}, so it scores on older gauges than that router would (set node.scrape_interval = \"{theirs}\" to \
                     match)",
                    human(self.node.scrape_interval)
                ));
            }
        }
        // Before 2026-12-06 a replica's `model` was informational; now it is the model it
        // serves, and a request is routed among its model's replicas only.
        let mut others: Vec<&str> = self
            .replicas
            .iter()
            .filter_map(|r| r.model.as_deref())
            .filter(|m| !m.is_empty() && *m != self.node.model)
            .collect();
        others.sort_unstable();
        others.dedup();
        if !others.is_empty() {
            out.push(format!(
                "replicas declare models other than node.model ({:?}): {others:?}; each serves only requests naming its \
                 model (a request naming none goes to node.model's replicas)",
                self.node.model
            ));
        }
        // Two replicas on one KV-event publisher would each be indexed with the other's blocks.
        let mut publishers = std::collections::BTreeMap::<&str, &str>::new();
        for r in self.replicas.iter().filter(|r| !r.kv_events_bind) {
            let Some(ep) = r.kv_events.as_deref() else { continue };
            if let Some(first) = publishers.insert(ep, &r.name) {
                out.push(format!(
                    "replicas {first:?} and {:?} subscribe to the same KV-event publisher {ep}: each would be indexed \
                     with the other's blocks (each engine, and each data-parallel rank, publishes on its own port)",
                    r.name
                ));
            }
        }
        // A disaggregated model needs both sides: one alone serves nothing.
        for (model, (prefill, decode)) in self.sides() {
            if prefill == 0 || decode == 0 {
                let (has, lacks) = if prefill > 0 { ("prefill", "decode") } else { ("decode", "prefill") };
                out.push(format!(
                    "model {model:?} has {has} replicas but no {lacks} replica: its requests go to its `both` replicas \
                     only, and the {has} replicas serve nothing until a {lacks} replica is added"
                ));
            }
        }
        if self.node.booking_lease < self.node.request_timeout {
            out.push(format!(
                "node.booking_lease (\"{}\") is shorter than node.request_timeout (\"{}\"): a proxied request that \
                 runs longer than the lease stops counting in its replica's token load while it runs",
                human(self.node.booking_lease),
                human(self.node.request_timeout)
            ));
        }
        let adm = &self.admission;
        match adm.ttft_slo {
            Some(_) if !adm.enabled => {
                out.push("admission.ttft_slo is set but admission.enabled is false: the TTFT gate is off".into())
            }
            Some(slo) if adm.max_wait > 10 * slo => out.push(format!(
                "admission.max_wait (\"{}\") is over 10x admission.ttft_slo (\"{}\"): late requests wait behind \
                 fresh ones and may wait up to max_wait; a few times the SLO (say 3x) bounds how late an answer can \
                 come",
                human(adm.max_wait),
                human(slo)
            )),
            _ => {}
        }
        let a = &self.autoscaler;
        if a.enabled && self.replicas.len() > a.policy.max_replicas as usize {
            out.push(format!(
                "autoscaler.max_replicas ({}) is below the {} replicas configured: no decision asks for more than {}",
                a.policy.max_replicas,
                self.replicas.len(),
                a.policy.max_replicas
            ));
        }
        out
    }

    /// Per model with disaggregated replicas: how many prefill and decode replicas it has.
    fn sides(&self) -> std::collections::BTreeMap<&str, (usize, usize)> {
        let mut sides = std::collections::BTreeMap::<&str, (usize, usize)>::new();
        for r in self.replicas.iter().filter(|r| r.role != Role::Both) {
            let e = sides.entry(r.model.as_deref().unwrap_or(&self.node.model)).or_default();
            if r.role == Role::Prefill {
                e.0 += 1;
            } else {
                e.1 += 1;
            }
        }
        sides
    }

    /// Checks values and combinations.
    ///
    /// # Errors
    /// The first refusal found: [`ConfigError::Setting`] naming the key,
    /// [`ConfigError::Replica`] naming the replica, or [`ConfigError::Conflict`].
    pub fn validate(&self) -> Result<(), ConfigError> {
        // One hand-over per model: a prefill replica's engine decides it, so a decode replica
        // of another engine would receive fields it does not read.
        let mut engines = std::collections::BTreeMap::<&str, (&str, &str)>::new();
        for r in self.replicas.iter().filter(|r| r.role != Role::Both) {
            let model = r.model.as_deref().unwrap_or(&self.node.model);
            let (first, name) = *engines.entry(model).or_insert((r.engine.as_str(), r.name.as_str()));
            if first != r.engine {
                return Err(ConfigError::Conflict(format!(
                    "model {model:?}: replica {:?} has engine {:?} but replica {name:?} has {first:?}; a disaggregated \
                     model's prefill and decode replicas must run one engine (it decides the hand-over)",
                    r.name, r.engine
                )));
            }
        }
        let kind = self.node.policy.parse::<PolicyKind>().map_err(|e| match e {
            kvmesh_core::Error::UnknownPolicy { name, known } => {
                ConfigError::setting("node.policy", format!("names no policy ({name:?}); known policies: {known}"))
            }
            other => ConfigError::setting("node.policy", format!("is refused: {other}")),
        })?;
        kind.build_with(&self.node.params()).map_err(|e| match e {
            kvmesh_core::Error::InvalidConfig { reason, .. } => {
                ConfigError::setting("node.policy_params", format!("has a bad entry: {reason}"))
            }
            other => ConfigError::setting("node.policy_params", format!("are refused: {other}")),
        })?;
        if self.node.block_size == 0 {
            return Err(ConfigError::setting("node.block_size", "must be positive"));
        }
        self.node.replica_profile()?;
        if self.node.proxy_threads == 0 {
            return Err(ConfigError::setting("node.proxy_threads", "must be at least 1"));
        }
        let n = &self.node;
        for (key, d) in [
            ("node.scrape_interval", n.scrape_interval),
            ("node.request_timeout", n.request_timeout),
            ("node.booking_lease", n.booking_lease),
            ("node.replay_timeout", n.replay_timeout),
            (
                "autoscaler.interval",
                std::time::Duration::try_from_secs_f64(self.autoscaler.policy.interval_s)
                    .unwrap_or(std::time::Duration::MAX),
            ),
            (
                "replication.interval",
                std::time::Duration::try_from_secs_f64(self.replication.plan.interval_s)
                    .unwrap_or(std::time::Duration::MAX),
            ),
        ] {
            up_to_a_day(key, d, false)?;
        }
        // 0 is meaningful here: no backoff after a 429/503; an owed event is overdue at once.
        for (key, d) in [("node.overload_backoff", n.overload_backoff), ("node.events_silent", n.events_silent)] {
            up_to_a_day(key, d, true)?;
        }
        let hung = n.hung_after;
        if !(hung.is_zero() || hung >= 2 * n.scrape_interval) {
            let default = if hung == NodeSection::default().hung_after { " (its default)" } else { "" };
            return Err(ConfigError::setting(
                "node.hung_after",
                format!(
                    "must be \"0s\" (off) or at least twice node.scrape_interval (\"{}\"), got \"{}\"{default}",
                    human(2 * n.scrape_interval),
                    human(hung)
                ),
            ));
        }
        let mut adapters = std::collections::HashSet::new();
        for a in &self.node.lora_adapters {
            if a.is_empty() || *a == self.node.model {
                return Err(ConfigError::setting(
                    "node.lora_adapters",
                    format!("has {a:?}: empty or the base model's name"),
                ));
            }
            if !adapters.insert(a) {
                return Err(ConfigError::setting("node.lora_adapters", format!("has {a:?} twice")));
            }
        }
        // A model named like an adapter could never be asked for: the adapter wins the name.
        if let Some(r) = self.replicas.iter().find(|r| r.model.as_ref().is_some_and(|m| adapters.contains(m))) {
            return Err(ConfigError::replica(
                &r.name,
                format!(
                    "model {:?} is also one of node.lora_adapters; a request naming it would get the adapter",
                    r.model.as_deref().unwrap_or_default()
                ),
            ));
        }
        if self.node.shutdown_grace > std::time::Duration::from_secs(3600) {
            return Err(ConfigError::setting(
                "node.shutdown_grace",
                format!("must be at most an hour (\"1h\"), got \"{}\"", human(self.node.shutdown_grace)),
            ));
        }
        self.replication.validate()?;
        self.autoscaler.validate()?;
        self.admission.validate()?;
        self.limits.validate()?;
        self.epp.validate()?;
        if let Some(c) = &self.cluster {
            if c.id == 0 {
                return Err(ConfigError::setting("cluster.id", "must be positive (or --id / KVMESH_NODE_ID)"));
            }
            let peers = c.peer_map()?;
            if !peers.is_empty() && !peers.contains_key(&c.id) {
                return Err(ConfigError::setting("cluster.peers", format!("must include this node (id {})", c.id)));
            }
            for (key, d) in [
                ("cluster.gossip_interval", c.gossip_interval),
                ("cluster.summary_interval", c.summary_interval),
                ("cluster.peer_timeout", c.peer_timeout),
                ("cluster.heartbeat", c.heartbeat),
                ("cluster.election_timeout_min", c.election_timeout_min),
                ("cluster.election_timeout_max", c.election_timeout_max),
            ] {
                up_to_a_day(key, d, false)?;
            }
            // In whole milliseconds, as openraft takes them.
            let ms = |d: std::time::Duration| d.as_millis();
            if ms(c.election_timeout_min) <= ms(c.heartbeat) || ms(c.election_timeout_max) <= ms(c.election_timeout_min)
            {
                return Err(ConfigError::Conflict(format!(
                    "cluster: need heartbeat < election_timeout_min < election_timeout_max, in whole milliseconds; got \
                     {} < {} < {} ms",
                    ms(c.heartbeat),
                    ms(c.election_timeout_min),
                    ms(c.election_timeout_max)
                )));
            }
            if c.peer_timeout <= 2 * c.summary_interval {
                return Err(ConfigError::Conflict(
                    "cluster: peer_timeout must exceed twice summary_interval (an idle peer is heard only through \
                     summaries)"
                        .into(),
                ));
            }
            if c.snapshot_every == 0 {
                return Err(ConfigError::setting("cluster.snapshot_every", "must be positive"));
            }
        }
        let mut names = std::collections::HashSet::new();
        let mut engines: std::collections::HashMap<(&str, Option<u32>), &str> = std::collections::HashMap::new();
        // One block size per model; node.model's is node.block_size.
        let mut sizes: std::collections::HashMap<&str, (u32, &str)> = std::collections::HashMap::new();
        for r in &self.replicas {
            r.validate()?;
            let model = r.model.as_deref().filter(|m| !m.is_empty()).unwrap_or(&self.node.model);
            let bs = r.block_size.unwrap_or(self.node.block_size);
            if model == self.node.model && bs != self.node.block_size {
                return Err(ConfigError::replica(
                    &r.name,
                    format!(
                        "block_size {bs} differs from node.block_size {} (a replica of node.model has its block size; \
                         another model may have its own)",
                        self.node.block_size
                    ),
                ));
            }
            for a in r.lora_adapters.iter().flatten() {
                let taken = *a == self.node.model
                    || self.replicas.iter().any(|o| o.model.as_deref() == Some(a.as_str()))
                    || self.node.lora_adapters.iter().any(|n| n == a) && model != self.node.model;
                if taken {
                    return Err(ConfigError::replica(
                        &r.name,
                        format!("lora_adapters: {a:?} is a model's name (or node.model's adapter) here"),
                    ));
                }
            }
            match sizes.get(model) {
                Some(&(other, first)) if other != bs => {
                    return Err(ConfigError::replica(
                        &r.name,
                        format!(
                            "block_size {bs} differs from replica {first:?}'s {other}: the replicas of model {model:?} \
                             must share one block size"
                        ),
                    ))
                }
                _ => {
                    sizes.insert(model, (bs, &r.name));
                }
            }
            if !names.insert(&r.name) {
                return Err(ConfigError::replica(&r.name, "the name appears twice"));
            }
            if let Some(first) = engines.insert(r.engine_key(), &r.name) {
                return Err(ConfigError::Conflict(format!(
                    "replicas {:?} and {:?} route to the same engine ({}{}): one engine under two names is booked \
                     and scraped twice",
                    first,
                    r.name,
                    r.http,
                    r.data_parallel_rank.map(|k| format!(", data-parallel rank {k}")).unwrap_or_default()
                )));
            }
        }
        Ok(())
    }

    /// The configuration as TOML.
    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_else(|e| format!("# cannot render: {e}"))
    }
}

#[cfg(test)]
mod tests;
