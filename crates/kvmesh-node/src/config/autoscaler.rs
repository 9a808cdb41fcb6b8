//! `[autoscaler]`: the Raft leader's scale decisions.

use serde::{Deserialize, Serialize};

/// `[autoscaler]`: the Raft leader (a single node: itself) decides how many replicas the
/// pool should have (`kvmesh_core::autoscale`: cold-start-aware, no cascade) and commits each
/// decision with its reason and inputs; `kvmesh.v1.Autoscaler` and KEDA's external-scaler
/// protocol serve them to an actuator. kvmesh does not start or stop engines itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AutoscalerSection {
    /// Decide and serve decisions.
    pub enabled: bool,
    /// The pool's name in decisions and the KEDA metric.
    pub pool: String,
    /// Seconds between decisions.
    pub interval_s: f64,
    /// Fewest replicas. 0 lets the pool scale to zero once no load arrives (KEDA's
    /// `IsActive` turns false), but not back: a request that finds no replica is refused
    /// before it counts as demand, so an operator (or KEDA's `minReplicaCount`) has to
    /// start the first one.
    pub min_replicas: u32,
    /// Most replicas.
    pub max_replicas: u32,
    /// Seconds a new replica takes to serve (until starts are measured from replicas
    /// registered `starting` that turn `ready`).
    pub cold_start_s: f64,
    /// Utilisation each replica should run at, in (0, 1].
    pub target_utilisation: f64,
    /// What one replica serves at full load, tokens per second; 0: measured from the engines'
    /// served-token counters (vLLM prompt − prefix-cache hits + generation tokens) while
    /// requests wait (at the engine, or at the router with `[admission]` while the engine runs
    /// full: `max_num_seqs` running or 90 % of its KV in use), and estimated from
    /// the engine profile until then. Admission control's `Retry-After` uses it too.
    pub capacity_tokens_per_s: f64,
    /// The pool shrinks only to the largest need of this last window, seconds; 0: one cold
    /// start (measured), the break-even of keeping an idle replica against restarting it.
    pub scale_down_delay_s: f64,
    /// A scale-down names the replicas to release (`drain` in the decision: starting ones
    /// first, then those with the fewest requests in flight and the least cache) and drains
    /// them in the same Raft entry, so no node routes to them; the actuator releases each
    /// once it is idle (`kvmesh replica drain --wait`). Leave it off when the actuator picks
    /// which engines go (KEDA scaling a Deployment: Kubernetes picks the pods, and a preStop
    /// hook drains each, see deploy/README.md). Turn it on only once every node runs a
    /// version that has it: an older node ignores the drain in the decision's entry.
    pub drain_on_scale_down: bool,
}

impl Default for AutoscalerSection {
    fn default() -> Self {
        let c = kvmesh_core::autoscale::AutoscaleConfig::default();
        AutoscalerSection {
            enabled: false,
            pool: "default".into(),
            interval_s: c.interval_s,
            min_replicas: c.min_replicas,
            max_replicas: c.max_replicas,
            cold_start_s: c.cold_start_s,
            target_utilisation: c.target_utilisation,
            capacity_tokens_per_s: 0.0,
            scale_down_delay_s: c.scale_down_delay_s,
            drain_on_scale_down: false,
        }
    }
}

impl AutoscalerSection {
    /// The core's settings.
    pub fn core(&self) -> kvmesh_core::autoscale::AutoscaleConfig {
        kvmesh_core::autoscale::AutoscaleConfig {
            interval_s: self.interval_s,
            min_replicas: self.min_replicas,
            max_replicas: self.max_replicas,
            cold_start_s: self.cold_start_s,
            target_utilisation: self.target_utilisation,
            scale_down_delay_s: self.scale_down_delay_s,
            ..kvmesh_core::autoscale::AutoscaleConfig::default()
        }
    }

    /// Checks ranges.
    ///
    /// # Errors
    /// A message naming the `autoscaler.` key.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.capacity_tokens_per_s.is_finite() && self.capacity_tokens_per_s >= 0.0) {
            return Err(format!("autoscaler.capacity_tokens_per_s must be ≥ 0, got {}", self.capacity_tokens_per_s));
        }
        self.core().validate().map_err(|e| match e {
            kvmesh_core::Error::InvalidConfig { field, reason } => format!("autoscaler.{field} {reason}"),
            other => format!("autoscaler: {other}"),
        })
    }
}
