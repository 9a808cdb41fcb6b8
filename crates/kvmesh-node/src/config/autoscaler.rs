//! `[autoscaler]`: the Raft leader's scale decisions.

use super::ConfigError;
use kvmesh_core::autoscale::AutoscaleConfig;
use serde::{Deserialize, Deserializer, Serialize};

/// `[autoscaler]`: the Raft leader (a single node: itself) decides how many replicas the
/// pool should have (`kvmesh_core::autoscale`: cold-start-aware, no cascade) and commits each
/// decision with its reason and inputs; `kvmesh.v1.Autoscaler` and KEDA's external-scaler
/// protocol serve them to an actuator. kvmesh does not start or stop engines itself.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AutoscalerSection {
    /// Decide and serve decisions.
    pub enabled: bool,
    /// The pool's name in decisions and the KEDA metric.
    pub pool: String,
    /// What one replica serves at full load, tokens per second; 0: measured from the engines'
    /// served-token counters (vLLM prompt − prefix-cache hits + generation tokens) while
    /// requests wait (at the engine, or at the router with `[admission]` while the engine runs
    /// full: `max_num_seqs` running or 90 % of its KV in use), and estimated from
    /// the engine profile until then. Admission control's `Retry-After` uses it too.
    pub capacity_tokens_per_s: f64,
    /// A scale-down names the replicas to release (`drain` in the decision: starting ones
    /// first, then those with the fewest requests in flight and the least cache) and drains
    /// them in the same Raft entry, so no node routes to them; the actuator releases each
    /// once it is idle (`kvmesh replica drain --wait`). Leave it off when the actuator picks
    /// which engines go (KEDA scaling a Deployment: Kubernetes picks the pods, and a preStop
    /// hook drains each, see deploy/README.md). Turn it on only once every node runs a
    /// version that has it: an older node ignores the drain in the decision's entry.
    pub drain_on_scale_down: bool,
    /// The scale policy's settings, keys of this same table (`interval`, `min_replicas`,
    /// `max_replicas`, `cold_start`, `target_utilisation`, `scale_down_delay`, …): read into
    /// `kvmesh_core::autoscale::AutoscaleConfig` as they are, defaults and docs included.
    #[serde(flatten)]
    pub policy: AutoscaleConfig,
}

/// The node's own keys of `[autoscaler]` (the rest are [`AutoscaleConfig`]'s).
#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Own {
    enabled: bool,
    pool: String,
    capacity_tokens_per_s: f64,
    drain_on_scale_down: bool,
}

impl Default for Own {
    fn default() -> Self {
        let d = AutoscalerSection::default();
        Own {
            enabled: d.enabled,
            pool: d.pool,
            capacity_tokens_per_s: d.capacity_tokens_per_s,
            drain_on_scale_down: d.drain_on_scale_down,
        }
    }
}

impl<'de> Deserialize<'de> for AutoscalerSection {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let (own, policy): (Own, AutoscaleConfig) = super::split::two(d)?;
        let Own { enabled, pool, capacity_tokens_per_s, drain_on_scale_down } = own;
        Ok(AutoscalerSection { enabled, pool, capacity_tokens_per_s, drain_on_scale_down, policy })
    }
}

impl Default for AutoscalerSection {
    fn default() -> Self {
        AutoscalerSection {
            enabled: false,
            pool: "default".into(),
            capacity_tokens_per_s: 0.0,
            drain_on_scale_down: false,
            policy: AutoscaleConfig::default(),
        }
    }
}

impl AutoscalerSection {
    /// Checks ranges.
    ///
    /// # Errors
    /// A message naming the `autoscaler.` key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(self.capacity_tokens_per_s.is_finite() && self.capacity_tokens_per_s >= 0.0) {
            return Err(ConfigError::setting(
                "autoscaler.capacity_tokens_per_s",
                format!("must be ≥ 0, got {}", self.capacity_tokens_per_s),
            ));
        }
        self.policy.validate().map_err(|e| ConfigError::from_core("autoscaler", e))
    }
}
