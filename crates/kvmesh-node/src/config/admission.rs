//! `[admission]`: holding requests that would miss their TTFT SLO.

use super::ConfigError;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// `[admission]`: while capacity is short — no replica with KV headroom for a request, or
/// every one at `node.max_num_seqs`, or (with `ttft_slo`) none where it would meet its TTFT
/// SLO — requests wait in a bounded queue and are routed as capacity frees (smallest token
/// load first); beyond the bound or after `max_wait`: 429 with `Retry-After` (the seconds
/// the routable replicas need to serve the backlog at `autoscaler.capacity_tokens_per_s` each,
/// which is measured when left at 0, even with the autoscaler off).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionSection {
    /// Queue requests while capacity is short instead of sending them to full replicas.
    pub enabled: bool,
    /// Requests that may wait at once on this node (1 to 1,000,000); beyond, 429.
    pub queue_limit: usize,
    /// Longest a request waits before 429 (at most a day). With `ttft_slo`, late requests wait
    /// behind fresh ones and may wait this long under sustained overload: a few times the SLO
    /// bounds how late an answer can come.
    #[serde(with = "humantime_serde")]
    pub max_wait: Duration,
    /// A TTFT SLO to hold requests to, e.g. `"2s"` (unset: off). A request then also waits when
    /// its estimated TTFT on the best replica exceeds what is left of the SLO and more than
    /// half the SLO is queued there; requests that have waited less than half the SLO go
    /// before those that have waited longer (late ones), and a full queue refuses its largest
    /// late request instead of a new one. Why: engines serve in arrival order, so a queue
    /// longer than the SLO makes every request behind it late.
    #[serde(with = "humantime_serde")]
    pub ttft_slo: Option<Duration>,
}

impl Default for AdmissionSection {
    fn default() -> Self {
        AdmissionSection { enabled: false, queue_limit: 256, max_wait: Duration::from_secs(30), ttft_slo: None }
    }
}

impl AdmissionSection {
    /// Checks ranges.
    ///
    /// # Errors
    /// A message naming the `admission.` key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        super::up_to_a_day("admission.max_wait", self.max_wait, false)?;
        // Each waiter is a parked request and its connection: a million is far past any node.
        if !(1..=1_000_000).contains(&self.queue_limit) {
            return Err(ConfigError::setting(
                "admission.queue_limit",
                format!("must be 1 to 1000000 requests, got {}", self.queue_limit),
            ));
        }
        if let Some(slo) = self.ttft_slo {
            super::up_to_a_day("admission.ttft_slo", slo, false)?;
            kvmesh_core::admission::TtftGate::new(slo.as_secs_f64())
                .map_err(|_| ConfigError::setting("admission.ttft_slo", "must be positive"))?;
        }
        Ok(())
    }
}
