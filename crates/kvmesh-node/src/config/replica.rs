//! `[[replicas]]`: one engine replica each.

use super::ConfigError;
use kvmesh_core::Role;
use serde::{Deserialize, Serialize};

/// Why a data-parallel entry must give its capacity.
const DP_CAPACITY: &str = "capacity_blocks is required for data-parallel ranks (vLLM reports the ranks' KV blocks \
                           summed): set it to one rank's blocks, its log's \"GPU KV cache size: N tokens\" / block_size";

/// One `[[replicas]]` entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaConfig {
    /// Unique name.
    pub name: String,
    /// Base URL of its OpenAI API (`http://host:port`, optionally with a path prefix). Plain
    /// HTTP only: `https://` is refused at load (the node's engine client has no TLS).
    pub http: String,
    /// Its KV-event publisher endpoint (`tcp://host:port`; `tcp://*:port` with
    /// `kv_events_bind`); `None`: it publishes none. Other transports (`ipc://`) are refused
    /// at load.
    #[serde(default)]
    pub kv_events: Option<String>,
    /// Its replay endpoint (`tcp://host:port`); `None`: gaps are recovered by dropping its
    /// blocks.
    #[serde(default)]
    pub replay: Option<String>,
    /// Bind the event endpoint instead of connecting (when the engine connects to the router).
    #[serde(default)]
    pub kv_events_bind: bool,
    /// Its Prometheus metrics URL; default `<http>/metrics`.
    #[serde(default)]
    pub metrics_url: Option<String>,
    /// KV-cache capacity, blocks. Omitted (or 0): read from the engine's metrics page (vLLM's
    /// `vllm:cache_config_info{num_gpu_blocks}`, which it publishes once it has sized its KV
    /// cache; counted in this replica's block size if the engine's differs); until a scrape brings it the replica is `starting` (`unhealthy` while the engine
    /// does not answer) and not routed to. Required
    /// for SGLang (its page does not say) and for a data-parallel rank (vLLM reports the ranks'
    /// blocks summed).
    #[serde(default)]
    pub capacity_blocks: u64,
    /// `vllm` or `sglang`. Both event formats are read either way; for a `prefill` or
    /// `decode` replica it decides how a disaggregated request is handed between its sides
    /// (vLLM's `kv_transfer_params`, SGLang's bootstrap room) and must be one of the two.
    #[serde(default = "default_engine")]
    pub engine: String,
    /// The model it serves (vLLM `--served-model-name`); default `node.model`. Requests for a
    /// model are routed only among the replicas serving it, on the prefix overlap of that
    /// model's blocks only (its KV events are hashed in the model's namespace). Several
    /// models may share one node; they share its tokenizer (each may have its own
    /// `block_size`), and replication warms `node.model`'s replicas only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The LoRA adapters it serves (vLLM `--lora-modules NAME=PATH`, or loaded at run time
    /// with `/v1/load_lora_adapter`). A request for an adapter goes only to replicas serving
    /// it. Default: learned from the engine's `/v1/models` (the entries with a `parent`),
    /// asked at start and every 10 s; until an answer comes, or when the engine lists no
    /// adapter at all (SGLang does not list them), the replica is taken to serve every adapter
    /// a request names. A declared empty list means it serves none (through the admin API an
    /// empty list means: learn them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_adapters: Option<Vec<String>>,
    /// Its KV block size (vLLM `--block-size`), tokens; default `node.block_size`. A replica
    /// of `node.model` must have `node.block_size`; another model may have its own, shared by
    /// all its replicas (its events, requests and KV are then counted in its blocks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// This entry is one data-parallel rank of an engine serving several behind one API
    /// server (vLLM `--data-parallel-size`), routed, indexed and loaded as a replica of its
    /// own: requests sent to it carry `X-data-parallel-rank: <rank>` (vLLM's API server then
    /// schedules them on that rank), its load is read from the `/metrics` series labelled
    /// `engine="<rank>"` (or `dp_rank`), and `kv_events`/`replay` are that rank's own
    /// publisher's (vLLM binds rank k's at the configured ports + k). Usually written for you
    /// by `data_parallel_size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_parallel_rank: Option<u32>,
    /// Shorthand for an engine's N data-parallel ranks: at load this entry becomes N entries
    /// `<name>-dp<k>` (k = 0…N−1), each with `data_parallel_rank = k`, `kv_events` and
    /// `replay` at the given ports + k (vLLM's `ZmqEventPublisher.offset_endpoint_port`,
    /// vllm/distributed/kv_events.py) and `capacity_blocks` each (one rank's KV, as that
    /// rank logs it). 1..=1024.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_parallel_size: Option<u32>,
    /// Its part in prefill/decode-disaggregated serving: `both` (default: it serves requests
    /// whole), `prefill` or `decode` (vLLM: a KV connector such as `NixlConnector` in
    /// `--kv-transfer-config`; SGLang: `--disaggregation-mode`). While a model has a routable
    /// replica of each side, each of its requests goes to one prefill and one decode replica,
    /// picked together (prefill by the node's policy — token load with prefix overlap by
    /// default — decode by KV headroom, then decode load); otherwise its `both` replicas serve
    /// it whole.
    #[serde(default, skip_serializing_if = "Role::is_both")]
    pub role: Role,
    /// A `prefill` replica of `engine = "sglang"`: its disaggregation bootstrap port
    /// (SGLang `--disaggregation-bootstrap-port`), sent to both sides as `bootstrap_port`.
    /// Default 8998, SGLang's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
}

/// SGLang's default `--disaggregation-bootstrap-port`.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// Most data-parallel ranks one `[[replicas]]` entry may stand for.
pub const MAX_DATA_PARALLEL_SIZE: u32 = 1024;

fn default_engine() -> String {
    "vllm".into()
}

impl ReplicaConfig {
    /// The engine this entry routes to: its `http` base URL (trailing `/` dropped) and its
    /// data-parallel rank. Two entries with one engine are one engine under two names.
    pub fn engine_key(&self) -> (&str, Option<u32>) {
        (self.http.trim_end_matches('/'), self.data_parallel_rank)
    }

    /// Whether `other` names the same engine ([`ReplicaConfig::engine_key`]).
    pub fn same_engine(&self, other: &ReplicaConfig) -> bool {
        self.engine_key() == other.engine_key()
    }

    /// This entry as the replicas it stands for: itself, or with `data_parallel_size` N one
    /// entry per rank (see [`ReplicaConfig::data_parallel_size`]).
    ///
    /// # Errors
    /// A size of 0 or over [`MAX_DATA_PARALLEL_SIZE`], a size beside a rank, or an endpoint
    /// whose port cannot be offset (no port, or past 65535).
    pub fn ranks(&self) -> Result<Vec<ReplicaConfig>, ConfigError> {
        let Some(size) = self.data_parallel_size else { return Ok(vec![self.clone()]) };
        let bad = |what: String| Err(ConfigError::replica(&self.name, what));
        if size == 0 || size > MAX_DATA_PARALLEL_SIZE {
            return bad(format!("data_parallel_size must be 1..={MAX_DATA_PARALLEL_SIZE}, got {size}"));
        }
        if self.data_parallel_rank.is_some() {
            return bad(
                "data_parallel_size and data_parallel_rank exclude each other (the size writes the ranks)".into()
            );
        }
        // Checked here, where the entry still has the name written in the file.
        if self.capacity_blocks == 0 {
            return bad(DP_CAPACITY.into());
        }
        let mut out = Vec::with_capacity(size as usize);
        for k in 0..size {
            let offset = |field: &str, ep: &Option<String>| match ep {
                Some(ep) => kvmesh_events::offset_endpoint_port(ep, k)
                    .map(Some)
                    .map_err(|e| ConfigError::replica(&self.name, format!("{field} {e}"))),
                None => Ok(None),
            };
            out.push(ReplicaConfig {
                name: format!("{}-dp{k}", self.name),
                kv_events: offset("kv_events", &self.kv_events)?,
                replay: offset("replay", &self.replay)?,
                data_parallel_rank: Some(k),
                data_parallel_size: None,
                ..self.clone()
            });
        }
        // vLLM moves both ports up by the rank: two ports fewer than `size` apart put one
        // rank's publisher on another's replay socket.
        let mut seen = std::collections::HashSet::new();
        for ep in out.iter().flat_map(|r| r.kv_events.iter().chain(r.replay.iter())) {
            if !seen.insert(ep.as_str()) {
                return bad(format!(
                    "with data_parallel_size {size}, {ep} is both a publisher and a replay socket (vLLM adds the \
                     rank to both ports): keep kv_events and replay at least {size} ports apart"
                ));
            }
        }
        Ok(out)
    }

    /// The metrics URL to scrape.
    pub fn metrics(&self) -> String {
        self.metrics_url.clone().unwrap_or_else(|| format!("{}/metrics", self.http.trim_end_matches('/')))
    }

    /// Checks the fields a node cannot run without.
    ///
    /// # Errors
    /// A message naming the replica and the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |what: &str| Err(ConfigError::replica(&self.name, what));
        if self.name.is_empty() {
            return bad("name must not be empty");
        }
        if self.http.starts_with("https://") {
            // Accepting it would fail every request later: the node's engine client is built
            // without a TLS backend.
            return bad(&format!(
                "http {:?}: https:// engines are not supported (the node talks plain HTTP to engines); \
                 use the engine's http:// address on the pod network, or a TLS-terminating sidecar beside it",
                self.http
            ));
        }
        if !self.http.starts_with("http://") {
            return bad(&format!("http must be an http:// URL, got {:?}", self.http));
        }
        if let Err(e) = crate::endpoints::Endpoints::parse(&self.http) {
            return bad(&format!("http: {e}"));
        }
        for (field, ep) in [("kv_events", &self.kv_events), ("replay", &self.replay)] {
            if let Some(ep) = ep {
                // What the frame guard will need at start; checked here, since at start a bad
                // endpoint would fail the replica's actor again and again.
                if let Err(e) = crate::endpoints::tcp_address(ep) {
                    return bad(&format!("{field} {e}"));
                }
            }
        }
        // 0: read from the engine, which only vLLM's page tells, and for the whole engine.
        if self.capacity_blocks == 0 && self.engine == "sglang" {
            return bad(
                "capacity_blocks is required for an sglang engine (its metrics do not report its KV capacity): \
                 set it to the engine's max_total_num_tokens / block size",
            );
        }
        if self.capacity_blocks == 0 && (self.data_parallel_rank.is_some() || self.data_parallel_size.is_some()) {
            return bad(DP_CAPACITY);
        }
        if self.data_parallel_size.is_some() {
            return bad("data_parallel_size is expanded into ranks when the file is read; register each rank (data_parallel_rank) through the API");
        }
        if self.data_parallel_rank.is_some_and(|k| k >= MAX_DATA_PARALLEL_SIZE) {
            return bad(&format!("data_parallel_rank must be below {MAX_DATA_PARALLEL_SIZE}"));
        }
        // Informational for a replica serving whole requests; the hand-over of a disaggregated
        // one depends on it.
        if self.role != Role::Both && self.engine != "vllm" && self.engine != "sglang" {
            return bad(&format!(
                "engine must be vllm or sglang for a {} replica (it decides the hand-over), got {:?}",
                self.role.as_str(),
                self.engine
            ));
        }
        if self.bootstrap_port.is_some() && (self.engine != "sglang" || self.role != Role::Prefill) {
            return bad("bootstrap_port is for a prefill replica of engine = \"sglang\" only");
        }
        for (i, a) in self.lora_adapters.iter().flatten().enumerate() {
            if a.is_empty() || Some(a) == self.model.as_ref() {
                return bad(&format!("lora_adapters: {a:?} is empty or the replica's model"));
            }
            if self.lora_adapters.iter().flatten().take(i).any(|b| b == a) {
                return bad(&format!("lora_adapters: {a:?} appears twice"));
            }
        }
        Ok(())
    }
}
