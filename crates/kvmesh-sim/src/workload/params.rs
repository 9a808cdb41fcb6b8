//! The size and pace every generated scenario takes ([`ScenarioParams`]).

/// Size and pace of a generated scenario.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScenarioParams {
    /// Requests to generate.
    pub requests: u32,
    /// Mean arrival rate, requests per second.
    pub rate: f64,
    /// RNG seed.
    pub seed: u64,
}

impl Default for ScenarioParams {
    /// 2,000 requests at 10 req/s, seed 1.
    fn default() -> Self {
        ScenarioParams { requests: 2000, rate: 10.0, seed: 1 }
    }
}
