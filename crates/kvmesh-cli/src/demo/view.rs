//! The live terminal view while a run goes: progress, requests/s, TTFT p50/p99, hit rate,
//! errors, the leader, and each replica's token load. Plain lines every 5 s when the output is
//! not a terminal.

use super::drive::Live;
use super::report::{pct, secs};
use super::tier::Tier;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The view of one run.
pub struct View {
    bars: Option<(MultiProgress, ProgressBar, ProgressBar, ProgressBar)>,
    policy: String,
    total: usize,
    speed: f64,
    started: Instant,
    last_plain: Instant,
}

impl View {
    /// A view for `total` requests routed by `policy`.
    pub fn new(policy: &str, total: usize, speed: f64, quiet: bool) -> View {
        let bars = (!quiet && std::io::stderr().is_terminal()).then(|| {
            let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stderr_with_hz(4));
            let style = ProgressStyle::with_template("{prefix:>12} [{bar:30}] {pos}/{len} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> ");
            let progress = multi.add(ProgressBar::new(total as u64).with_style(style).with_prefix(policy.to_string()));
            let line = || {
                multi.add(
                    ProgressBar::new_spinner().with_style(
                        ProgressStyle::with_template("{prefix:>12} {msg}")
                            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
                    ),
                )
            };
            let (cluster, load) = (line().with_prefix("cluster"), line().with_prefix("token load"));
            (multi, progress, cluster, load)
        });
        let now = Instant::now();
        View { bars, policy: policy.to_string(), total, speed, started: now, last_plain: now }
    }

    /// Redraws from the run's progress and the tier's state.
    pub fn update(&mut self, live: &Arc<Mutex<Live>>, tier: &Tier) {
        let (sent, done, stats) = {
            let l = live.lock().unwrap_or_else(|p| p.into_inner());
            let mut ttft: Vec<f64> = l.done.iter().filter_map(|o| o.ttft_s).collect();
            ttft.sort_by(f64::total_cmp);
            let errors = l.done.iter().filter(|o| o.error.is_some()).count();
            let ok = || l.done.iter().filter(|o| o.error.is_none());
            let prompt: u64 = ok().map(|o| o.prompt_tokens as u64).sum();
            let cached: u64 = ok().map(|o| o.cached_tokens as u64).sum();
            let hit =
                if prompt == 0 { "—".to_string() } else { format!("{:.0}%", cached as f64 / prompt as f64 * 100.0) };
            // (Nothing to show before a first token: a dash, not a 0 that reads as measured.)
            let ttft = |q| if ttft.is_empty() { "—".to_string() } else { secs(pct(&ttft, q)) };
            (l.sent, l.done.len(), (ttft(0.5), ttft(0.99), hit, errors))
        };
        // Engine seconds, like --rate and every other figure.
        let rate = done as f64 / (self.started.elapsed().as_secs_f64() * self.speed).max(1e-3);
        let msg = format!(
            "{rate:.1} completed/s · TTFT (completed) p50 {} p99 {} · hit rate {} · errors {} · in flight {}",
            stats.0,
            stats.1,
            stats.2,
            stats.3,
            sent - done
        );
        let mut leader = match tier.leader() {
            Some((id, term)) => format!("{} router nodes · leader node {id} (term {term})", tier.nodes.len()),
            None => format!("{} router node(s)", tier.nodes.len()),
        };
        if let Some(d) = tier.scale_decision() {
            leader.push_str(&format!(
                " · autoscaler: {} engines wanted ({}, load {:.0}k tokens/s)",
                d.desired_replicas,
                d.reason,
                d.demand_tokens_per_s / 1e3
            ));
        }
        if let Some(plan) = tier.replication_plan() {
            let [pending, warming, confirmed, _] = plan.target_counts();
            leader.push_str(&format!(
                " · replication plan v{}: {} hot prefix(es), targets {confirmed} confirmed / {} warming",
                plan.version,
                plan.prefixes.len(),
                pending + warming
            ));
        }
        let load: Vec<String> = tier
            .token_load()
            .into_iter()
            .map(|(name, tokens)| {
                format!(
                    "{name} {}",
                    if tokens >= 1000 { format!("{:.1}k", tokens as f64 / 1e3) } else { tokens.to_string() }
                )
            })
            .collect();
        match &self.bars {
            Some((_, progress, cluster, token_load)) => {
                progress.set_position(done as u64);
                progress.set_message(msg);
                cluster.set_message(leader);
                token_load.set_message(format!("queued prefill tokens: {}", load.join(" · ")));
            }
            None => {
                if self.last_plain.elapsed() >= Duration::from_secs(5) {
                    self.last_plain = Instant::now();
                    eprintln!(
                        "[{}] {done}/{} done · {msg} · {leader} · queued prefill tokens: {}",
                        self.policy,
                        self.total,
                        load.join(" · ")
                    );
                }
            }
        }
    }

    /// Removes the view from the terminal.
    pub fn finish(self) {
        if let Some((multi, a, b, c)) = self.bars {
            for bar in [a, b, c] {
                bar.finish_and_clear();
            }
            let _ = multi.clear();
        }
    }
}
