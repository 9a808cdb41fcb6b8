//! A replica's configuration ↔ the gRPC API's `ReplicaSpec` (`proto/kvmesh/v1/admin.proto`).

use super::ReplicaConfig;
use kvmesh_proto::v1;
use tonic::Status as GrpcStatus;

impl ReplicaConfig {
    /// This replica as the API's `ReplicaSpec`, its block size `block_size` when it has none
    /// of its own.
    pub(crate) fn to_spec(&self, block_size: u32) -> v1::ReplicaSpec {
        let c = self;
        v1::ReplicaSpec {
            name: c.name.clone(),
            http_endpoint: c.http.clone(),
            kv_events_endpoint: c.kv_events.clone().unwrap_or_default(),
            replay_endpoint: c.replay.clone().unwrap_or_default(),
            kv_events_bind: c.kv_events_bind,
            metrics_url: c.metrics(),
            model: c.model.clone().unwrap_or_default(),
            engine: c.engine.clone(),
            block_size: c.block_size.unwrap_or(block_size),
            capacity_blocks: c.capacity_blocks,
            data_parallel_rank: c.data_parallel_rank,
            lora_adapters: c.lora_adapters.clone().unwrap_or_default(),
            role: if c.role.is_both() { String::new() } else { c.role.as_str().to_string() },
            bootstrap_port: c.bootstrap_port.map(u32::from),
        }
    }

    /// The registry's entry for an `AddReplica` spec.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT` for a role that is not `both`, `prefill` or `decode`, or a bootstrap
    /// port past 65535.
    pub(crate) fn from_spec(s: v1::ReplicaSpec) -> Result<ReplicaConfig, GrpcStatus> {
        let opt = |v: String| (!v.is_empty()).then_some(v);
        let role = s.role.parse::<kvmesh_core::Role>().map_err(GrpcStatus::invalid_argument)?;
        let bootstrap_port = s
            .bootstrap_port
            .map(|p| {
                u16::try_from(p).map_err(|_| GrpcStatus::invalid_argument(format!("bootstrap_port {p} is past 65535")))
            })
            .transpose()?;
        Ok(ReplicaConfig {
            name: s.name,
            http: s.http_endpoint,
            kv_events: opt(s.kv_events_endpoint),
            replay: opt(s.replay_endpoint),
            kv_events_bind: s.kv_events_bind,
            metrics_url: opt(s.metrics_url),
            capacity_blocks: s.capacity_blocks,
            engine: opt(s.engine).unwrap_or_else(|| "vllm".into()),
            model: opt(s.model),
            block_size: (s.block_size != 0).then_some(s.block_size),
            data_parallel_rank: s.data_parallel_rank,
            data_parallel_size: None,
            lora_adapters: (!s.lora_adapters.is_empty()).then_some(s.lora_adapters),
            role,
            bootstrap_port,
        })
    }
}
