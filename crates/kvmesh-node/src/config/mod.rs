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
//!                                     # (omit: read from the engine's /metrics num_gpu_blocks)
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

use serde::{Deserialize, Serialize};
use std::path::Path;

mod admission;
mod autoscaler;
mod cluster;
mod doubts;
mod epp;
mod error;
mod files;
mod hints;
mod limits;
mod locate;
mod node;
mod replica;
mod replication;
mod spec;
mod split;
mod validate;
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
    /// [`NodeConfig::validate_file`] (every refusal, at its line).
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let config = Self::read(path)?;
        config.validate_file(path)?;
        Ok(config)
    }

    /// [`NodeConfig::validate`] for a configuration read from the file at `path`.
    ///
    /// # Errors
    /// Every refusal ([`NodeConfig::refusals`]), a line each, as `path:line: message` where
    /// the file (as it is now) sets the refused value ([`ConfigError::line_in`]).
    pub fn validate_file(&self, path: &Path) -> anyhow::Result<()> {
        refuse_at_lines(self.refusals(), path)
    }

    /// [`NodeConfig::validate_file`], and the files the configuration names checked for being
    /// there ([`NodeConfig::unreadable_files`]): what a node starting from the file (or
    /// `--check`) refuses before it reads anything else. Not for a reload, which reads none of
    /// those files.
    ///
    /// # Errors
    /// Every refusal, then every unreadable file, a line each, as [`NodeConfig::validate_file`].
    pub fn validate_file_to_start(&self, path: &Path) -> anyhow::Result<()> {
        let mut refusals = self.refusals();
        refusals.extend(self.unreadable_files());
        refuse_at_lines(refusals, path)
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
        let mut config: NodeConfig = toml::from_str(text)
            .map_err(|e| ConfigError::Syntax { message: locate::located(&e, text), hint: hints::hint(&e, text) })?;
        config.expand_data_parallel()?;
        Ok(config)
    }

    /// The configuration as TOML.
    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_else(|e| format!("# cannot render: {e}"))
    }
}

/// `refusals` of the configuration read from `path`, each at its line of the file as it is now.
fn refuse_at_lines(refusals: Vec<ConfigError>, path: &Path) -> anyhow::Result<()> {
    if refusals.is_empty() {
        return Ok(());
    }
    let text = std::fs::read_to_string(path).ok();
    let lines: Vec<String> = refusals.iter().map(|e| e.located_in(path, text.as_deref())).collect();
    anyhow::bail!("{}", lines.join("\n"))
}

#[cfg(test)]
mod tests;
