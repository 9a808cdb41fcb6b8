//! `[replication]`: hot-prefix detection and partial KV replication.

use super::ConfigError;
use kvmesh_core::replication::ReplicationConfig;
use serde::{Deserialize, Deserializer, Serialize};

/// `[replication]`: hot-prefix detection and partial KV replication (see
/// `kvmesh_core::replication`). Every node counts the prefixes it routes and gossips its
/// hottest; the Raft leader (or a single node) plans and sends warm-ups — prefill-only
/// requests with `max_tokens: 1` through the replica's OpenAI API, sent as token ids, so the
/// node needs the model's `tokenizer` (or engines that tokenize like kvmesh's approximate
/// scheme, such as kvmesh-engine-sim).
///
/// ```toml
/// [replication]
/// enabled = true
/// interval = "250ms"
/// cooldown = "30s"
/// sketch = { capacity = 4096, half_life = "10s" }
/// ```
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplicationSection {
    /// Detect hot prefixes and replicate them. Off by default: warm-ups are requests kvmesh
    /// sends to your engines by itself.
    pub enabled: bool,
    /// Prefixes a node gossips per report, every `interval` (token ids go with the hottest 4
    /// only).
    pub report_top: usize,
    /// gRPC address (`http://host:port`) of a sidecar implementing
    /// `kvmesh.v1.ReplicationTransfer` (LMCache, NIXL, Mooncake store): called before warming
    /// with a prefill, which remains the fallback. Empty: prefill warm-ups only.
    pub transfer_endpoint: String,
    /// The plan's settings, keys of this same table (`interval`, `target_utilisation`,
    /// `min_requests_per_s`, `cooldown`, `grace_ttl`, `warm_timeout`, `sketch`, …): read into
    /// `kvmesh_core::replication::ReplicationConfig` as they are, defaults and docs included.
    /// `interval` is also how often nodes gossip their counts; a warm-up request (transfer call
    /// and prefill together) must finish within 90 % of `warm_timeout`.
    #[serde(flatten)]
    pub plan: ReplicationConfig,
}

/// The node's own keys of `[replication]` (the rest are [`ReplicationConfig`]'s).
#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Own {
    enabled: bool,
    report_top: usize,
    transfer_endpoint: String,
}

impl Default for Own {
    fn default() -> Self {
        let d = ReplicationSection::default();
        Own { enabled: d.enabled, report_top: d.report_top, transfer_endpoint: d.transfer_endpoint }
    }
}

impl<'de> Deserialize<'de> for ReplicationSection {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let (own, plan): (Own, ReplicationConfig) = super::split::two(d)?;
        let Own { enabled, report_top, transfer_endpoint } = own;
        Ok(ReplicationSection { enabled, report_top, transfer_endpoint, plan })
    }
}

impl Default for ReplicationSection {
    fn default() -> Self {
        ReplicationSection {
            enabled: false,
            report_top: 16,
            transfer_endpoint: String::new(),
            plan: ReplicationConfig::default(),
        }
    }
}

impl ReplicationSection {
    /// How often the leader plans and nodes gossip their counts.
    pub fn interval(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.plan.interval_s)
    }

    /// Checks ranges.
    ///
    /// # Errors
    /// A message naming the `replication.` key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.report_top == 0 {
            return Err(ConfigError::setting("replication.report_top", "must be positive"));
        }
        let e = &self.transfer_endpoint;
        if !(e.is_empty() || e.starts_with("http://") || e.starts_with("https://")) {
            return Err(ConfigError::setting(
                "replication.transfer_endpoint",
                format!("must be an http:// or https:// gRPC address, got {:?}", self.transfer_endpoint),
            ));
        }
        self.plan.validate().map_err(|e| ConfigError::from_core("replication", e))
    }
}
