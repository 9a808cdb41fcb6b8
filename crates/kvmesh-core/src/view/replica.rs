//! One engine replica as the fleet knows it: identity, capacity, speed, status and the
//! freshness of its signals.

use super::status::ReplicaStatus;
use crate::ids::ReplicaId;
use crate::load::{EngineMetrics, PrefillRate, ReplicaProfile};

/// What an operator registers for a replica.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaSpec {
    /// A stable, unique name (`"vllm-0"`, a pod name). Consistent hashing places replicas by
    /// name, so every router node agrees whatever the registration order (case C11).
    pub name: String,
    /// KV-cache capacity, in blocks of `block_size` tokens (vLLM logs it as "GPU KV cache
    /// size: N tokens"; divide by the block size, or read `num_gpu_blocks` of its
    /// `vllm:cache_config_info` metric). 0: not known yet — the replica is not routable until
    /// [`crate::Fleet::set_capacity_blocks`] gives it.
    pub capacity_blocks: u64,
    /// The replica's step-time model.
    pub profile: ReplicaProfile,
    /// Whether the replica is configured to publish KV events. Replicas that don't are routed
    /// on the router's own record (approximate mode).
    pub publishes_events: bool,
    /// The model it serves (vLLM's `--served-model-name`); empty: the fleet's namespace model
    /// ([`crate::FleetConfig::namespace`]). Only requests for this model are routed to it, and
    /// its KV events are hashed in this model's namespace, so its blocks never count as
    /// another model's overlap.
    pub model: String,
    /// Tokens per KV block of its engine when its model's differ from the fleet's
    /// ([`crate::FleetConfig::block_size`]); 0: the fleet's. Only a replica of another model
    /// than the namespace model may differ, and every replica of one model must agree: its
    /// events, its requests' hashes, its overlaps and its KV are all counted in its model's
    /// blocks.
    pub block_size: u32,
    /// The part of a request it serves: both (today's aggregated serving), or one side of a
    /// prefill/decode-disaggregated pair ([`Role`]). Default [`Role::Both`].
    pub role: Role,
}

/// The part of a request a replica serves, as vLLM's disaggregated serving splits it
/// (`--kv-transfer-config` with a KV connector such as `NixlConnector`; vLLM's
/// `tests/v1/kv_connector/nixl_integration/toy_proxy_server.py` shows the flow) and SGLang's
/// (`--disaggregation-mode prefill|decode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[repr(u8)]
pub enum Role {
    /// Prefill and decode on one replica (aggregated serving).
    #[default]
    Both,
    /// Computes prompts and hands their KV to a decode replica.
    Prefill,
    /// Receives a prompt's KV from a prefill replica and generates the answer.
    Decode,
}

impl Role {
    /// `both`, `prefill` or `decode`, as in configs, the API and metric labels.
    pub fn as_str(&self) -> &'static str {
        match self {
            Role::Both => "both",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl Role {
    /// Whether this is [`Role::Both`] (a config field left out).
    pub fn is_both(&self) -> bool {
        *self == Role::Both
    }
}

impl std::str::FromStr for Role {
    type Err = String;

    /// Parses [`Role::as_str`]'s names (empty: `both`).
    ///
    /// # Errors
    /// A message naming the three roles.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "" | "both" => Ok(Role::Both),
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            other => Err(format!("role must be both, prefill or decode, got {other:?}")),
        }
    }
}

impl ReplicaSpec {
    /// A replica named `name` with `capacity_blocks` blocks, the default profile, publishing
    /// events.
    pub fn new(name: impl Into<String>, capacity_blocks: u64) -> Self {
        ReplicaSpec {
            name: name.into(),
            capacity_blocks,
            profile: ReplicaProfile::default(),
            publishes_events: true,
            model: String::new(),
            block_size: 0,
            role: Role::Both,
        }
    }
}

/// Where a replica's overlap figures come from at a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverlapSource {
    /// Its own KV events, through the prefix index.
    Events,
    /// The router's own routing record: the replica publishes no events, none arrived yet
    /// (case C09: a silent publisher is routed on the record, not on a silent zero), or its
    /// stream is unusable (block-size mismatch, out of sync).
    Approximate,
}

/// One registered replica.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaState {
    /// Dense id within the fleet.
    pub id: ReplicaId,
    /// What was registered.
    pub spec: ReplicaSpec,
    /// xxh3 of the name: the replica's place on the consistent-hash ring.
    pub name_key: u64,
    /// The model it serves (its spec's, or the fleet's namespace model when that is empty).
    pub model: crate::hashing::ModelKey,
    /// Its status as the node last set it ([`ReplicaStatus::routable`]: takes new requests
    /// or not).
    pub status: ReplicaStatus,
    /// When its last accepted KV event was applied, seconds; `None` before the first.
    pub last_event_at: Option<f64>,
    /// When this router last routed a request to it, seconds.
    pub last_routed_at: Option<f64>,
    /// When it last delivered a first token, seconds. A first token after the last event
    /// means the replica computed (and cached) blocks it has not told us about yet.
    pub last_first_token_at: Option<f64>,
    /// Whether its event stream can be trusted for overlaps: no block-size mismatch (case C04)
    /// and not out of sync (case C03). When false, it is routed in approximate mode.
    pub events_usable: bool,
    /// Its latest engine load report.
    pub metrics: Option<EngineMetrics>,
    /// KV blocks this router had booked there when that report came, blocks: what it books
    /// or releases after the report moves the engine's figure by as much.
    pub kv_booked_at_report: u64,
    /// Its prefill cost as learned from delivered first tokens.
    pub prefill: PrefillRate,
}

impl ReplicaState {
    /// Whether new requests may go here: its status says so, and its KV capacity is known.
    pub fn routable(&self) -> bool {
        self.status.routable() && self.spec.capacity_blocks > 0
    }

    /// The step model decisions use: the registered profile, with the learned prefill cost in
    /// place of β1 when `learn` is on and enough first tokens were seen.
    #[inline]
    pub fn profile(&self, learn: bool) -> ReplicaProfile {
        match self.prefill.s_per_token() {
            Some(b1) if learn => ReplicaProfile { prefill_s_per_token: b1, ..self.spec.profile },
            _ => self.spec.profile,
        }
    }

    /// Where this replica's overlaps come from now.
    pub fn overlap_source(&self) -> OverlapSource {
        if self.spec.publishes_events && self.last_event_at.is_some() && self.events_usable {
            OverlapSource::Events
        } else {
            OverlapSource::Approximate
        }
    }
}
