//! Where a data-parallel rank publishes: vLLM runs one `ZmqEventPublisher` per data-parallel
//! rank, each binding the configured `endpoint` and `replay_endpoint` with the port moved up
//! by the rank (`ZmqEventPublisher.offset_endpoint_port`, vllm/distributed/kv_events.py), and
//! annotates its batches with `data_parallel_rank`.

/// `endpoint` (`tcp://host:port`) as data-parallel rank `rank` publishes it: the port plus
/// the rank (rank 0, or port 0 — "any free port" — unchanged).
///
/// # Errors
/// The endpoint has no numeric port after its last `:`, or the port plus the rank is past
/// 65535.
pub fn offset_endpoint_port(endpoint: &str, rank: u32) -> Result<String, EndpointError> {
    let bad = |problem| EndpointError { endpoint: endpoint.to_string(), problem };
    let Some((base, port)) = endpoint.rsplit_once(':') else {
        return Err(bad(EndpointProblem::NoPort));
    };
    let port: u32 = port.parse().map_err(|_| bad(EndpointProblem::PortNotANumber(port.to_string())))?;
    if rank == 0 || port == 0 {
        return Ok(endpoint.to_string());
    }
    match u16::try_from(port.saturating_add(rank)) {
        Ok(p) => Ok(format!("{base}:{p}")),
        Err(_) => Err(bad(EndpointProblem::PastLastPort { port, rank })),
    }
}

/// An endpoint a data-parallel rank cannot be given ([`offset_endpoint_port`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{endpoint:?}{problem}")]
pub struct EndpointError {
    /// The endpoint as configured.
    pub endpoint: String,
    /// What is wrong with it.
    pub problem: EndpointProblem,
}

/// What is wrong with an endpoint ([`EndpointError`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointProblem {
    /// No `:` before a port.
    #[error(" has no port to offset by the data-parallel rank")]
    NoPort,
    /// The text after the last `:` is not a number.
    #[error(": port {0:?} is not a number")]
    PortNotANumber(String),
    /// The port plus the rank is past 65535.
    #[error(": port {port} + rank {rank} is past 65535")]
    PastLastPort {
        /// The configured port.
        port: u32,
        /// The rank.
        rank: u32,
    },
}

#[cfg(test)]
mod tests {
    use super::offset_endpoint_port as offset;
    use super::EndpointProblem;

    #[test]
    fn ranks_publish_at_the_port_plus_the_rank() {
        assert_eq!(offset("tcp://10.0.0.7:5557", 0).unwrap(), "tcp://10.0.0.7:5557");
        assert_eq!(offset("tcp://10.0.0.7:5557", 3).unwrap(), "tcp://10.0.0.7:5560");
        assert_eq!(offset("tcp://*:5558", 1).unwrap(), "tcp://*:5559");
        assert_eq!(offset("tcp://[fd00::7]:5557", 2).unwrap(), "tcp://[fd00::7]:5559");
        assert_eq!(offset("tcp://127.0.0.1:0", 5).unwrap(), "tcp://127.0.0.1:0");
        assert_eq!(
            offset("tcp://h:65535", 1).unwrap_err().to_string(),
            "\"tcp://h:65535\": port 65535 + rank 1 is past 65535"
        );
        assert_eq!(offset("tcp://h:x", 1).unwrap_err().to_string(), "\"tcp://h:x\": port \"x\" is not a number");
        assert_eq!(
            offset("tcp://h:65535", 1).unwrap_err().problem,
            EndpointProblem::PastLastPort { port: 65535, rank: 1 }
        );
        assert_eq!(
            offset("nowhere", 1).unwrap_err().to_string(),
            "\"nowhere\" has no port to offset by the data-parallel rank"
        );
    }
}
