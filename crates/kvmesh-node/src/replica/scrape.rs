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
    // Whether the engine's own KV block count was compared with `capacity_blocks` (once).
    let mut capacity_checked = false;
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
        let (configured, follows) = (r.config.capacity_blocks, r.config.kv_events.is_some());
        match result {
            Ok(page) => {
                // In blocks of another size the counts do not compare (a block-size mismatch is
                // reported on its own, from the KV events).
                let ours = core.fleet.replica_block_size(target.id());
                let same_size = page.kv_block_size.is_none_or(|b| b == ours);
                if configured == 0 {
                    // Registered without capacity_blocks: the engine's own figure, on every
                    // page (a restarted engine may have sized its cache anew), in this node's
                    // blocks: its KV holds as many tokens whatever the block size (a block-size
                    // mismatch is reported on its own, as with a configured capacity).
                    // (At most 2^40 blocks: a page is network input, and the core counts free
                    // blocks in i64.)
                    let theirs = u64::from(page.kv_block_size.unwrap_or(ours));
                    let tokens = page.kv_blocks.map(|b| b.saturating_mul(theirs));
                    match tokens.map(|t| (t / u64::from(ours.max(1))).min(1 << 40)).filter(|&b| b > 0) {
                        Some(blocks) => {
                            if let Some(previous) = core.learn_capacity(&name, blocks, now) {
                                tracing::info!(
                                    replica = %name,
                                    capacity_blocks = blocks,
                                    previous,
                                    engine_blocks = page.kv_blocks.unwrap_or(0),
                                    engine_block_size = ?page.kv_block_size,
                                    "KV capacity read from the engine (vllm:cache_config_info num_gpu_blocks)"
                                );
                            }
                        }
                        // (Said once, and only while no figure was ever read: a later page
                        // without one leaves the last figure in place.)
                        None if !capacity_checked
                            && core.fleet.replica(target.id()).is_some_and(|f| f.spec.capacity_blocks == 0) =>
                        {
                            capacity_checked = true;
                            tracing::warn!(
                                replica = %name,
                                %url,
                                "capacity_blocks is not configured and the engine's metrics page does not report its \
                                 KV capacity (no vllm:cache_config_info num_gpu_blocks of at least one block): the \
                                 replica stays starting, not routed to; set capacity_blocks"
                            );
                        }
                        None => {}
                    }
                } else if let (false, Some(engine_blocks), true, None) =
                    (capacity_checked, page.kv_blocks, same_size, rank)
                {
                    // (Not for a data-parallel rank: vLLM reports the ranks' blocks summed.)
                    capacity_checked = true;
                    if configured != engine_blocks {
                        tracing::warn!(
                            replica = %name,
                            capacity_blocks = configured,
                            engine_blocks,
                            "capacity_blocks differs from the KV blocks the engine allocated (vllm:cache_config_info \
                             num_gpu_blocks): kvmesh judges KV headroom and evictions by capacity_blocks; set it to \
                             the engine's figure"
                        );
                    }
                }
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
