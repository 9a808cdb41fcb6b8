//! Engine load and health: one replica's Prometheus endpoint, scraped at an interval.
//!
//! A good scrape reports running/waiting/KV usage to the routing core and the tokens the
//! engine served to the autoscaler's capacity meter (at full load while requests wait at the
//! engine, or in the router's admission queue while the engine runs full), and clears the
//! failure count;
//! `unhealthy_after` failures in a row (connect error, non-200, unparseable page, a page over
//! `limits.metrics_max_page_bytes`) take the replica out of rotation until a scrape succeeds
//! again. The page is parsed on tokio's blocking pool: a slow parse of one engine's page never
//! holds a runtime worker that routing needs.
//!
//! The generated-token counter also tells when the engine restarted: it only rises while the
//! engine runs and starts again from 0, so a page whose count is below the previous one means
//! the engine's cache is gone, even if the engine publishes no KV event afterwards (an idle one
//! does not). Its blocks are then dropped and, with a replay socket, rebuilt from what the new
//! engine holds — unless the ingest task saw the restart itself since the previous page (its
//! sequence went back), which it has handled already. (Not the served-token count: vLLM's can
//! fall for a while without a restart, see [`kvmesh_events::EnginePage::generated_tokens`].)

use super::apply::Target;
use crate::state::Shared;
use kvmesh_events::parse_engine_page_of;
use std::sync::Arc;
use std::time::Duration;

/// KV usage (fraction of its blocks) at which an engine counts as full.
const ENGINE_FULL_KV: f64 = 0.9;

/// Scrapes `url` every `interval` for replica `name` (`target`: its records) until aborted:
/// the whole page, or with `rank` the series of that data-parallel rank of the engine only.
pub async fn run(
    shared: Arc<Shared>,
    name: String,
    target: Target,
    (url, rank): (String, Option<u32>),
    interval: Duration,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Whether the one-time word on the engine's KV capacity was said ([`follow_capacity`]).
    let mut capacity_said = false;
    // The generated-token count of the last good page, and when it was read (node seconds).
    let mut last_generated: Option<(f64, f64)> = None;
    loop {
        tick.tick().await;
        let asked_at = shared.now();
        let fetched = scrape(&shared, &url, interval).await;
        let now = shared.now();
        // Parse before taking the core lock, off the runtime's workers: a vLLM page runs to
        // hundreds of kilobytes, and a hostile one is built to parse slowly.
        let result = match fetched {
            Ok(text) => {
                tokio::task::spawn_blocking(move || parse_engine_page_of(&text, now, rank).map_err(|e| e.to_string()))
                    .await
                    .unwrap_or_else(|e| Err(format!("parsing the page: {e}")))
            }
            Err(e) => Err(e.to_string()),
        };
        // For the autoscaler's capacity meter: tokens served, and requests queued for the
        // replica. Requests held at the router by admission control queue for it too (the
        // router keeps the engines' own queues empty while capacity is short) — when the engine
        // is full itself: the router's count of room is conservative (it books every request's
        // whole max_tokens), and a part-loaded engine's rate is no capacity.
        let served = match &result {
            Ok(kvmesh_events::EnginePage { metrics: m, served_tokens: Some(served), .. }) => {
                let full = m.running >= shared.settings.profile.max_num_seqs || m.kv_usage >= ENGINE_FULL_KV;
                let held = if full { u32::try_from(shared.admission.depth()).unwrap_or(u32::MAX) } else { 0 };
                Some((*served, m.waiting.saturating_add(held)))
            }
            _ => None,
        };
        let generated = result.as_ref().ok().and_then(|p| p.generated_tokens);
        let previous = last_generated;
        let restarted = generated.is_some_and(|g| previous.is_some_and(|(last, _)| g < last));
        if let Some(g) = generated {
            last_generated = Some((g, now));
        }
        if let Ok(page) = &result {
            // SGLang counts tokens as requests finish: its counter stands still through a
            // long request, so it says nothing about a hang.
            let mut h = target.health().lock();
            h.counts_every_step = page.dialect == kvmesh_events::Dialect::Vllm;
            h.engine_block_size = page.kv_block_size;
            h.engine_kv_blocks = page.kv_blocks;
        }
        let mut core = shared.core();
        // Removed since its actor started (and perhaps added again under the same name, with
        // an actor of its own): this task's pages are not the registered replica's.
        let Some(r) = core.replicas.get(&name).filter(|r| r.id == target.id()) else { continue };
        let follows = r.config.kv_events.is_some();
        match result {
            Ok(page) => {
                let engine = engine_capacity(page.kv_blocks, page.kv_block_size, core.fleet.replica_block_size(r.id));
                capacity_said = follow_capacity(&mut core, &name, engine, capacity_said, now);
                core.record_metrics(&name, page.metrics, page.served_tokens, asked_at, now)
            }
            Err(e) => {
                if let Some(status) = core.record_failure(&name, e.clone(), now) {
                    tracing::debug!(replica = %name, error = %e, status = status.as_str(), "scrape failed");
                }
            }
        }
        drop(core);
        if let Some((served, queued)) = served {
            shared.autoscaler.observe_served(&name, served, queued, now);
        }
        // Seen by the ingest task since the previous page: handled there already.
        let seen = || target.stream().lock().restart_seen_at.is_some_and(|t| previous.is_some_and(|(_, at)| t >= at));
        if restarted && !seen() {
            tracing::warn!(replica = %name, "the engine's generated-token counter went back: it restarted; dropping its blocks");
            if follows {
                // Its ingest task rebuilds (clear, then replay).
                target.stream().lock().resync_requested.get_or_insert("restart");
            } else {
                super::apply::resync_by_clearing(&shared, &name, &target, "restart");
            }
        }
    }
}

/// The KV capacity an engine's page reports, in the replica's blocks of `ours` tokens: its
/// `blocks` of `block_size` tokens (the replica's size when the page does not say) hold as many
/// tokens whatever the block size (a block-size mismatch is reported on its own). `None` when
/// the page does not say, or says less than one block; at most 2^40 blocks (a page is network
/// input, and the core counts free blocks in i64).
fn engine_capacity(blocks: Option<u64>, block_size: Option<u32>, ours: u32) -> Option<u64> {
    let tokens = blocks?.saturating_mul(u64::from(block_size.unwrap_or(ours)));
    Some((tokens / u64::from(ours.max(1))).min(1 << 40)).filter(|&b| b > 0)
}

/// Follows replica `name`'s KV capacity as its engine reports it (`engine`, see
/// [`engine_capacity`]) at `now`. Registered without `capacity_blocks`, the engine's figure is
/// the replica's, page after page (a restarted engine may have sized its cache anew); a page
/// without one is said once, while no figure was ever read. A configured figure is compared
/// with the engine's once (not for a data-parallel rank: vLLM reports the ranks' blocks
/// summed). Returns whether the one-time word was said (`said`: before).
fn follow_capacity(core: &mut crate::state::Core, name: &str, engine: Option<u64>, said: bool, now: f64) -> bool {
    let Some(r) = core.replicas.get(name) else { return said };
    let (id, configured, rank) = (r.id, r.config.capacity_blocks, r.config.data_parallel_rank);
    match (configured, engine) {
        (0, Some(blocks)) => {
            if let Some(previous) = core.learn_capacity(name, blocks, now) {
                tracing::info!(
                    replica = %name,
                    capacity_blocks = blocks,
                    previous,
                    "KV capacity read from the engine (vllm:cache_config_info num_gpu_blocks)"
                );
            }
            said
        }
        (0, None) if !said && core.fleet.replica_capacity_blocks(id) == 0 => {
            tracing::warn!(
                replica = %name,
                url = %r.config.metrics(),
                "capacity_blocks is not configured and the engine's metrics page does not report its KV capacity \
                 (no vllm:cache_config_info num_gpu_blocks of at least one block): the replica stays starting, not \
                 routed to; set capacity_blocks"
            );
            true
        }
        (configured, Some(engine_blocks)) if configured > 0 && !said && rank.is_none() => {
            if configured != engine_blocks {
                tracing::warn!(
                    replica = %name,
                    capacity_blocks = configured,
                    engine_blocks,
                    "capacity_blocks differs from the KV blocks the engine allocated (vllm:cache_config_info \
                     num_gpu_blocks, in this replica's block size): kvmesh judges KV headroom and evictions by \
                     capacity_blocks; set it to the engine's figure"
                );
            }
            true
        }
        _ => said,
    }
}

/// Why a metrics page was not read; each names the URL.
#[derive(Debug, thiserror::Error)]
enum ScrapeError {
    /// No answer: refused, timed out, reset (the error's whole chain).
    #[error("GET {url}: {chain}")]
    Request { url: String, chain: String },
    /// An answer that is not 2xx.
    #[error("GET {url}: HTTP {status}")]
    Status { url: String, status: reqwest::StatusCode },
    /// A page past `limits.metrics_max_page_bytes`, by its length or as read.
    #[error("GET {url}: page over limits.metrics_max_page_bytes ({max} bytes)")]
    TooLong { url: String, max: usize },
}

async fn scrape(shared: &Shared, url: &str, interval: Duration) -> Result<String, ScrapeError> {
    let timeout = interval.max(Duration::from_millis(500));
    let request = |e: reqwest::Error| ScrapeError::Request { url: url.into(), chain: crate::errors::error_chain(&e) };
    let resp = shared.probe_http.get(url).timeout(timeout).send().await.map_err(request)?;
    if !resp.status().is_success() {
        return Err(ScrapeError::Status { url: url.into(), status: resp.status() });
    }
    let max = shared.limits.metrics_max_page_bytes;
    let too_long = || ScrapeError::TooLong { url: url.into(), max };
    if resp.content_length().is_some_and(|n| n > max as u64) {
        return Err(too_long());
    }
    // Read by chunks, so a page without a length (or lying about it) is cut at the limit.
    let mut page = Vec::new();
    let mut resp = resp;
    while let Some(chunk) = resp.chunk().await.map_err(request)? {
        if page.len() + chunk.len() > max {
            return Err(too_long());
        }
        page.extend_from_slice(&chunk);
    }
    Ok(String::from_utf8_lossy(&page).into_owned())
}

#[cfg(test)]
mod tests {
    use super::engine_capacity;

    #[test]
    fn an_engines_capacity_counts_in_the_replicas_blocks() {
        assert_eq!(engine_capacity(Some(1_000), Some(16), 16), Some(1_000));
        assert_eq!(engine_capacity(Some(1_000), None, 16), Some(1_000), "unlabelled: the replica's size");
        assert_eq!(engine_capacity(Some(1_000), Some(32), 16), Some(2_000), "as many tokens");
        assert_eq!(engine_capacity(Some(1_001), Some(8), 16), Some(500), "whole blocks only");
        assert_eq!(engine_capacity(Some(1), Some(8), 16), None, "less than one block");
        assert_eq!(engine_capacity(None, Some(16), 16), None);
        assert_eq!(engine_capacity(Some(u64::MAX), Some(16), 16), Some(1 << 40), "capped");
    }
}
