//! Synthetic scenarios for the traffic shapes that decide which routing strategy wins.
//!
//! Every scenario yields a [`Trace`] with prefix-chained block ids of 512 tokens (as Mooncake's
//! `hash_ids`), Poisson arrivals unless stated, output lengths uniform in 64–512 tokens (50–600
//! for `chat`, the [`super::Workload`]'s), and is a pure function of its [`ScenarioParams`]
//! (seeded).
//!
//! | name | shape |
//! |---|---|
//! | `shared-0`, `shared-50`, `shared-90` | 4,096-token prompts whose first 0 / 50 / 90 % (rounded to 512-token blocks) is one of 8 system prompts, the rest unique |
//! | `hot-prompt` | 60 % of requests start with one 3,072-token system prompt, 40 % with one of 200 others; 1,024 unique tokens each (case C13) |
//! | `hot-rotating` | as `hot-prompt`, but the hot prompt is replaced by a new one every 20 s: a hot prompt appears suddenly (case C13 with the appearance; what replication is for) |
//! | `zipf` | 3,072-token documents drawn from 1,000 with Zipf popularity (s = 1.1), then 1,024 unique tokens |
//! | `bursts` | agent traffic: bursts of 64 requests within 1 s sharing one 3,072-token context, bursts every `64 / rate` s on average; peak concurrency far above the mean rate |
//! | `chat` | multi-turn sessions ([`super::Workload`]) at `rate` from the first request: sessions start 150 s before the window kept, as in a trace cut from a running service |
//! | `rl` | asynchronous RL rollouts: steps of 16 prompts × 8 samples, heavy-tailed outputs, `max_tokens` 8,192 ([`super::rollouts`]) |

pub use super::params::ScenarioParams;
use super::Workload;
use crate::trace::{mooncake::BLOCK_TOKENS, Trace, TraceFormat, TraceRequest};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::fmt;
use std::str::FromStr;

/// `hot-rotating`: seconds each hot prompt stays hot.
pub const HOT_PERIOD_S: f64 = 20.0;

/// A scenario by name.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scenario {
    /// System prompts shared at `percent` % of each prompt.
    Shared {
        /// Shared share of each prompt, percent.
        percent: u32,
    },
    /// One prompt carries 60 % of traffic.
    HotPrompt,
    /// One prompt carries 60 % of traffic, a new one every 20 s.
    HotRotating,
    /// Zipf document popularity.
    Zipf,
    /// Agent bursts.
    Bursts,
    /// Multi-turn chat sessions.
    Chat,
    /// RL rollouts in steps ([`super::rollouts`]).
    Rl,
    /// Agent tool loops ([`super::agents`]).
    Agents,
}

/// How long before the chat scenario's window its sessions start, seconds: the longest a
/// default chat session takes turns (6 turns, up to 30 s apart).
const CHAT_WARM_S: f64 = 150.0;

impl Scenario {
    /// Every scenario name.
    pub const NAMES: [&'static str; 10] =
        ["shared-0", "shared-50", "shared-90", "hot-prompt", "hot-rotating", "zipf", "bursts", "chat", "rl", "agents"];

    /// Generates the scenario's trace.
    pub fn generate(&self, p: &ScenarioParams) -> Trace {
        let mut g = Gen { rng: SmallRng::seed_from_u64(p.seed), next_id: 0, t: 0.0, out: Vec::new() };
        match *self {
            Scenario::Rl => return super::rollouts::generate(p),
            Scenario::Agents => return super::agents::generate(p),
            Scenario::Chat => {
                // Sessions average 3.5 turns: pace sessions so requests arrive at `rate`. They
                // start `CHAT_WARM_S` before the window kept: by then every session that can
                // still be taking turns has begun, so requests arrive at `rate` from the first
                // one on (a window opening with the sessions took only first turns at first:
                // 300 requests at 10 req/s arrived at 5.2 req/s). Enough sessions are made to
                // fill the window whatever the turns drawn; the count kept is exact.
                let session_rate = p.rate / 3.5;
                let span = CHAT_WARM_S + f64::from(p.requests) / p.rate;
                let w = Workload {
                    sessions: (1.5 * span * session_rate).ceil() as u32 + 16,
                    session_rate,
                    seed: p.seed,
                    ..Workload::default()
                };
                let mut t = w.generate();
                t.requests.retain(|r| r.arrival_s >= CHAT_WARM_S);
                t.requests.truncate(p.requests as usize);
                let first = t.requests.first().map_or(0.0, |r| r.arrival_s);
                for r in &mut t.requests {
                    r.arrival_s -= first;
                }
                return t;
            }
            Scenario::Shared { percent } => {
                let shared_blocks = ((percent.min(100) as f64 / 100.0) * 8.0).round() as usize;
                let prompts: Vec<Vec<u64>> = (0..8).map(|_| g.ids(shared_blocks)).collect();
                for _ in 0..p.requests {
                    g.advance(p.rate);
                    let mut ids = prompts[g.rng.random_range(0..8)].clone();
                    ids.extend(g.ids(8 - shared_blocks));
                    g.push(ids, 8 * BLOCK_TOKENS);
                }
            }
            Scenario::HotPrompt => {
                let hot = g.ids(6);
                let others: Vec<Vec<u64>> = (0..200).map(|_| g.ids(6)).collect();
                for _ in 0..p.requests {
                    g.advance(p.rate);
                    let mut ids =
                        if g.rng.random_bool(0.6) { hot.clone() } else { others[g.rng.random_range(0..200)].clone() };
                    ids.extend(g.ids(2));
                    g.push(ids, 8 * BLOCK_TOKENS);
                }
            }
            Scenario::HotRotating => {
                let mut hot = (0u64, g.ids(6));
                let others: Vec<Vec<u64>> = (0..200).map(|_| g.ids(6)).collect();
                for _ in 0..p.requests {
                    g.advance(p.rate);
                    let period = (g.t / HOT_PERIOD_S) as u64;
                    if period != hot.0 {
                        hot = (period, g.ids(6));
                    }
                    let mut ids =
                        if g.rng.random_bool(0.6) { hot.1.clone() } else { others[g.rng.random_range(0..200)].clone() };
                    ids.extend(g.ids(2));
                    g.push(ids, 8 * BLOCK_TOKENS);
                }
            }
            Scenario::Zipf => {
                let docs: Vec<Vec<u64>> = (0..1000).map(|_| g.ids(6)).collect();
                let cdf = zipf_cdf(1000, 1.1);
                for _ in 0..p.requests {
                    g.advance(p.rate);
                    let u: f64 = g.rng.random();
                    let k = cdf.partition_point(|&c| c < u).min(999);
                    let mut ids = docs[k].clone();
                    ids.extend(g.ids(2));
                    g.push(ids, 8 * BLOCK_TOKENS);
                }
            }
            Scenario::Bursts => {
                let burst = 64;
                let mut left = p.requests;
                while left > 0 {
                    // Bursts arrive at rate / 64 per second, so the mean rate is `rate`.
                    g.advance(p.rate / burst as f64);
                    let start = g.t;
                    let context = g.ids(6);
                    for _ in 0..burst.min(left) {
                        g.t = start + g.rng.random::<f64>();
                        let mut ids = context.clone();
                        let extra = g.rng.random_range(2..=4);
                        ids.extend(g.ids(extra));
                        g.push(ids, (6 + extra as u32) * BLOCK_TOKENS);
                    }
                    g.t = start;
                    left -= burst.min(left);
                }
            }
        }
        g.out.sort_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s));
        let first = g.out.first().map_or(0.0, |r| r.arrival_s);
        for r in &mut g.out {
            r.arrival_s -= first;
        }
        Trace { format: TraceFormat::Mooncake, block_tokens: Some(BLOCK_TOKENS), requests: g.out, skipped: Vec::new() }
    }
}

struct Gen {
    rng: SmallRng,
    next_id: u64,
    t: f64,
    out: Vec<TraceRequest>,
}

impl Gen {
    fn ids(&mut self, n: usize) -> Vec<u64> {
        let ids = (self.next_id..self.next_id + n as u64).collect();
        self.next_id += n as u64;
        ids
    }

    /// Moves time on by an exponential gap at `rate` per second.
    fn advance(&mut self, rate: f64) {
        self.t += -(1.0 - self.rng.random::<f64>()).ln() / rate;
    }

    fn push(&mut self, block_ids: Vec<u64>, input_tokens: u32) {
        let output_tokens = self.rng.random_range(64..=512);
        self.out.push(TraceRequest {
            arrival_s: self.t,
            input_tokens,
            output_tokens,
            block_ids,
            max_tokens: None,
            group: None,
        });
    }
}

/// Cumulative Zipf(s) probabilities over ranks 1..=n.
fn zipf_cdf(n: usize, s: f64) -> Vec<f64> {
    let w: Vec<f64> = (1..=n).map(|k| 1.0 / (k as f64).powf(s)).collect();
    let total: f64 = w.iter().sum();
    let mut acc = 0.0;
    w.iter()
        .map(|x| {
            acc += x / total;
            acc
        })
        .collect()
}

impl FromStr for Scenario {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "shared-0" => Scenario::Shared { percent: 0 },
            "shared-50" => Scenario::Shared { percent: 50 },
            "shared-90" => Scenario::Shared { percent: 90 },
            "hot-prompt" => Scenario::HotPrompt,
            "hot-rotating" => Scenario::HotRotating,
            "zipf" => Scenario::Zipf,
            "bursts" => Scenario::Bursts,
            "chat" => Scenario::Chat,
            "rl" => Scenario::Rl,
            "agents" => Scenario::Agents,
            other => return Err(format!("unknown scenario {other:?}; known: {}", Scenario::NAMES.join(", "))),
        })
    }
}

impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scenario::Shared { percent } => write!(f, "shared-{percent}"),
            Scenario::HotPrompt => f.write_str("hot-prompt"),
            Scenario::HotRotating => f.write_str("hot-rotating"),
            Scenario::Zipf => f.write_str("zipf"),
            Scenario::Bursts => f.write_str("bursts"),
            Scenario::Chat => f.write_str("chat"),
            Scenario::Rl => f.write_str("rl"),
            Scenario::Agents => f.write_str("agents"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analyze::analyze;
    use std::collections::HashMap;

    fn gen(name: &str) -> Trace {
        name.parse::<Scenario>().unwrap().generate(&ScenarioParams { requests: 1000, rate: 10.0, seed: 3 })
    }

    #[test]
    fn sharing_ratios_give_their_reuse() {
        // 8 blocks per prompt; the shared blocks repeat after each prompt's first use.
        let reuse = |n: &str| analyze(&gen(n), 1).prefix.unwrap().reuse_ratio;
        assert_eq!(reuse("shared-0"), 0.0);
        assert!((reuse("shared-50") - 0.5 * (1000.0 - 8.0) / 1000.0).abs() < 1e-9);
        assert!(
            (reuse("shared-90") - 7.0 / 8.0 * (1000.0 - 8.0) / 1000.0).abs() < 1e-9,
            "90 % rounds to 7 of 8 blocks"
        );
    }

    #[test]
    fn chat_arrives_at_its_rate_from_the_first_request() {
        for (requests, seed) in [(300, 1), (300, 2), (2000, 1)] {
            let t = Scenario::Chat.generate(&ScenarioParams { requests, rate: 10.0, seed });
            assert_eq!(t.requests.len(), requests as usize);
            assert_eq!(t.requests[0].arrival_s, 0.0);
            let rate = f64::from(requests) / t.requests.last().unwrap().arrival_s;
            assert!((8.5..11.5).contains(&rate), "{requests} requests, seed {seed}: {rate:.2} req/s");
        }
    }

    #[test]
    fn hot_prompt_carries_about_60_percent() {
        let t = gen("hot-prompt");
        let first = t.requests.iter().filter(|r| r.block_ids[0] == 0).count();
        assert!((560..=640).contains(&first), "{first}");
        assert_eq!(t.requests.len(), 1000);
    }

    #[test]
    fn the_rotating_hot_prompt_changes_every_period() {
        let t = Scenario::HotRotating.generate(&ScenarioParams { requests: 3500, rate: 50.0, seed: 1 });
        // Per 20 s period: the most common first block, and its share of the period's requests.
        let mut periods: Vec<HashMap<u64, usize>> = Vec::new();
        for r in &t.requests {
            let k = (r.arrival_s / HOT_PERIOD_S) as usize;
            periods.resize_with(periods.len().max(k + 1), HashMap::new);
            *periods[k].entry(r.block_ids[0]).or_default() += 1;
        }
        let mut hot_ids = Vec::new();
        for p in &periods[..periods.len() - 1] {
            let (&id, &n) = p.iter().max_by_key(|(_, &n)| n).unwrap();
            let share = n as f64 / p.values().sum::<usize>() as f64;
            assert!((0.55..0.65).contains(&share), "{share}");
            hot_ids.push(id);
        }
        assert_eq!(hot_ids.len(), 3);
        hot_ids.dedup();
        assert_eq!(hot_ids.len(), 3, "a new hot prompt each period");
    }

    #[test]
    fn bursts_keep_the_mean_rate_with_peaks_far_above_it() {
        let t = gen("bursts");
        let span = t.requests.last().unwrap().arrival_s;
        let mean = t.requests.len() as f64 / span;
        let peak = t.requests.windows(64).map(|w| 63.0 / (w[63].arrival_s - w[0].arrival_s)).fold(0.0, f64::max);
        // 64 requests inside one second, against a mean of ~10/s (only 16 bursts: noisy).
        assert!(peak > 63.0 && peak > 4.0 * mean, "peak {peak} mean {mean}");
    }

    #[test]
    fn every_scenario_has_exactly_the_requests_asked_for() {
        for n in Scenario::NAMES {
            assert_eq!(gen(n).requests.len(), 1000, "{n}");
        }
    }

    #[test]
    fn scenarios_are_seeded_and_names_round_trip() {
        for n in Scenario::NAMES {
            let s: Scenario = n.parse().unwrap();
            assert_eq!(s.to_string(), n);
            assert_eq!(gen(n), gen(n));
        }
        assert!("nope".parse::<Scenario>().unwrap_err().starts_with("unknown scenario \"nope\"; known: shared-0"));
    }
}
