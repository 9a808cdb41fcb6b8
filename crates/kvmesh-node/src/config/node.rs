//! `[node]`: node-wide settings.

use super::ConfigError;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::time::Duration;

/// `[node]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeSection {
    /// HTTP listen address (OpenAI proxy, `/health`, `/metrics`).
    pub http: SocketAddr,
    /// gRPC listen address.
    pub grpc: SocketAddr,
    /// Routing policy name.
    pub policy: String,
    /// The policy's parameters by name (the fields of its `…Params` in kvmesh-core, e.g.
    /// `{ move_weight = 0.5 }` for token_load); unset ones keep their defaults.
    pub policy_params: std::collections::BTreeMap<String, f64>,
    /// Tokens per KV block.
    pub block_size: u32,
    /// The default served model (vLLM `--served-model-name`): replicas that declare no
    /// `model` of their own serve it, and requests that name no model, or this one, are
    /// routed among them. A request naming a replica's declared model goes to that model's
    /// replicas only; any other name gets 404. Empty: any name no replica declares is taken
    /// as the default model.
    pub model: String,
    /// LoRA adapters of `node.model` (vLLM `--lora-modules NAME=PATH`; clients ask for one by
    /// `model: NAME`), askable before any engine lists them. A request for an adapter is
    /// routed on the prefix overlap of blocks stored under it only (vLLM's block hash and its
    /// `BlockStored.lora_name` include the adapter), never the base model's, and only to
    /// replicas serving it (`[[replicas]] lora_adapters`, else learned from each engine's
    /// `/v1/models`). gRPC `Route` takes the adapter in `lora_name` (any name when this list
    /// is empty and no engine listed it).
    #[serde(default)]
    pub lora_adapters: Vec<String>,
    /// Engine metrics scrape (and health check) interval.
    #[serde(with = "humantime_serde")]
    pub scrape_interval: Duration,
    /// Consecutive failed scrapes before a replica is unhealthy. A failed connect, or a
    /// failed scrape of a replica never scraped well yet, takes it out at once.
    pub unhealthy_after: u32,
    /// How long a 429/503 from a replica keeps it out of rotation (at most a day; `"0s"`:
    /// not at all).
    #[serde(with = "humantime_serde")]
    pub overload_backoff: Duration,
    /// Other replicas tried after a connect failure, a connection closed unanswered, or a
    /// backpressure answer.
    pub retries: u32,
    /// Upper bound on one proxied request.
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    /// A booking not released ends by itself this long after it was made or after its first
    /// token (at most a day): the load of a gRPC `Route` caller that never calls
    /// `Release` (or crashed) stops counting then. Keep it at least `request_timeout`, or
    /// long proxied requests stop counting while they run.
    #[serde(with = "humantime_serde")]
    pub booking_lease: Duration,
    /// On shutdown (SIGTERM, Ctrl-C), the node first stops reporting ready (`/health` 503,
    /// gRPC health `NOT_SERVING`, so load balancers and gateways send elsewhere) and lets the
    /// requests it follows — proxied, or picked for a gateway — finish, for at most this long
    /// (at most an hour); then it stops, cutting what is left. Keep the pod's
    /// `terminationGracePeriodSeconds` above it.
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
    /// Expect a request that gives `max_tokens` to produce what completed requests whose first
    /// 4 KV blocks of prompt match produced (once 4 have), re-estimated as a streamed answer
    /// decodes, instead of booking its whole `max_tokens` as decode work and KV. RL trainers and
    /// agents send a `max_tokens` far above their outputs; booked whole it made every replica
    /// look full (BENCHMARKS.md, decode-heavy traffic). Off: `max_tokens` is booked as given
    /// (a client's `x-kvmesh-expected-output-tokens` hint still wins).
    pub learn_output_lengths: bool,
    /// A replica that owes a KV event this long (a request filled KV blocks it did not hold,
    /// and no event came since the request began) is reported `no_events` (at most a day;
    /// `"0s"`: as soon as one is owed).
    #[serde(with = "humantime_serde")]
    pub events_silent: Duration,
    /// A replica whose engine served no token this long (its served-token counter standing
    /// still at every scrape) while this node's proxy had requests in flight on it at every
    /// scrape is reported `unhealthy` (hung: an engine whose metrics endpoint still answers);
    /// `"0s"`: off. It is routed around until the counter moves, or tried again once
    /// nothing of this node's was in flight on it for this long. vLLM pages only (its prompt
    /// and generation token totals move every step; vLLM counts a prompt when its first token
    /// comes, so keep this above the longest prefill); at least twice the scrape interval.
    #[serde(with = "humantime_serde")]
    pub hung_after: Duration,
    /// How long to wait for each replay reply.
    #[serde(with = "humantime_serde")]
    pub replay_timeout: Duration,
    /// The model's `tokenizer.json` (Hugging Face format): prompts are routed on the engine's
    /// real token ids, and chats rendered with the `chat_template` of the
    /// `tokenizer_config.json` beside it. Without one, on kvmesh's approximate ids
    /// (`kvmesh_core::prompt`), which match only engines using the same scheme
    /// (kvmesh-engine-sim).
    pub tokenizer: Option<std::path::PathBuf>,
    /// The engines' step-time profile the token-load estimates use: `h100` or `a100`
    /// (Llama-3-8B under vLLM; see `kvmesh_core::load::ReplicaProfile`).
    pub engine_profile: String,
    /// Longest prompt the proxy routes, tokens; longer ones get 413 before any work (the
    /// request body itself is capped at 64 MiB).
    pub max_prompt_tokens: u32,
    /// Time compression of the engines: step times are divided by this. 1 for real engines;
    /// kvmesh-engine-sim's `--speed` for stand-in ones (`kvmesh demo` sets it).
    pub engine_speed: f64,
    /// Most sequences each engine runs at once: vLLM's `--max-num-seqs`, SGLang's
    /// `--max-running-requests`. A replica at this many requests makes new ones wait for a
    /// slot, and `token_load` counts that wait.
    pub max_num_seqs: u32,
    /// Threads serving the HTTP proxy, on a runtime of their own with their own connections
    /// to the engines (KV events, gRPC, Raft and scrapes run on the main runtime, `--workers`).
    /// Request bodies of 16 KiB and more are parsed and tokenized on a blocking pool either
    /// way. 2 (the default): a request that is slow anyway (a chat template, a `/metrics`
    /// page) holds up only its thread. 1 keeps every hand-off on one thread: a little less CPU
    /// per request, and more requests/s on a small machine. Raise it on machines with cores
    /// to spare for the proxy.
    pub proxy_threads: u32,
}

impl NodeSection {
    /// `policy_params` as the list `PolicyKind::build_with` takes.
    pub fn params(&self) -> Vec<(String, f64)> {
        self.policy_params.iter().map(|(k, v)| (k.clone(), *v)).collect()
    }

    /// The step-time profile for token-load estimates, with `engine_speed` applied.
    ///
    /// # Errors
    /// An unknown profile name or a non-positive speed.
    pub fn replica_profile(&self) -> Result<kvmesh_core::load::ReplicaProfile, ConfigError> {
        let base = match self.engine_profile.as_str() {
            "h100" => kvmesh_core::load::ReplicaProfile::H100_LLAMA3_8B,
            "a100" => kvmesh_core::load::ReplicaProfile::A100_LLAMA3_8B,
            other => {
                return Err(ConfigError::setting(
                    "node.engine_profile",
                    format!("names an unknown profile {other:?} (use h100 or a100)"),
                ))
            }
        };
        if !(self.engine_speed.is_finite() && self.engine_speed > 0.0) {
            return Err(ConfigError::setting(
                "node.engine_speed",
                format!("must be a positive number, got {}", self.engine_speed),
            ));
        }
        if self.max_num_seqs == 0 {
            return Err(ConfigError::setting("node.max_num_seqs", "must be positive"));
        }
        let s = self.engine_speed;
        Ok(kvmesh_core::load::ReplicaProfile {
            prefill_s_per_token: base.prefill_s_per_token / s,
            decode_s_per_token: base.decode_s_per_token / s,
            step_overhead_s: base.step_overhead_s / s,
            chunk_tokens: base.chunk_tokens,
            max_num_seqs: self.max_num_seqs,
        })
    }
}

impl Default for NodeSection {
    fn default() -> Self {
        NodeSection {
            http: SocketAddr::from(([0, 0, 0, 0], 8080)),
            grpc: SocketAddr::from(([0, 0, 0, 0], 50051)),
            policy: "token_load".into(),
            policy_params: Default::default(),
            block_size: 16,
            model: String::new(),
            lora_adapters: Vec::new(),
            scrape_interval: Duration::from_secs(1),
            unhealthy_after: 3,
            overload_backoff: Duration::from_secs(2),
            retries: 2,
            request_timeout: Duration::from_secs(600),
            booking_lease: Duration::from_secs(600),
            shutdown_grace: Duration::from_secs(30),
            learn_output_lengths: true,
            events_silent: Duration::from_secs(30),
            hung_after: Duration::from_secs(60),
            replay_timeout: Duration::from_secs(1),
            tokenizer: None,
            engine_profile: "h100".into(),
            max_prompt_tokens: 1 << 20,
            engine_speed: 1.0,
            max_num_seqs: 256,
            proxy_threads: 2,
        }
    }
}
