//! Unit tests of `fleet`.

use super::*;

fn model(capacity: usize) -> ReplicaModel {
    let config = FleetConfig { capacity_blocks: capacity, request_rate: 4.0, ..FleetConfig::default() };
    ReplicaModel::new(&config, 0, Arc::new(SystemPrompts::new(&config)))
}

/// Replays `steps` steps into a set of held blocks, checking each event against it.
fn run(m: &mut ReplicaModel, steps: usize) -> (std::collections::HashSet<u64>, usize) {
    let mut held = std::collections::HashSet::new();
    let mut batches = 0;
    for _ in 0..steps {
        let events = m.step(0.04);
        batches += usize::from(!events.is_empty());
        for e in events {
            match e {
                KvEvent::Stored(s) => {
                    assert_eq!(s.token_ids.len(), s.block_hashes.len() * 16);
                    assert!(s.parent.is_none_or(|p| held.contains(&p.0)), "parent held");
                    for h in s.block_hashes {
                        assert!(held.insert(h.0), "a block stored twice");
                    }
                }
                KvEvent::Removed(r) => {
                    for h in r.block_hashes {
                        assert!(held.remove(&h.0), "removed a block not held");
                    }
                }
                KvEvent::Cleared => unreachable!(),
            }
        }
        assert_eq!(held.len(), m.cached);
        assert!(m.cached <= m.capacity);
    }
    (held, batches)
}

#[test]
fn events_are_a_consistent_cache_that_stays_within_capacity() {
    let mut m = model(2_048);
    let (held, batches) = run(&mut m, 3_000);
    // Full by then (4 requests/s for 120 s, ≥ 20 blocks each, is far beyond 2,048), and
    // evicting: the cache stays within one step's stores of its capacity.
    assert!(held.len() > 2_048 - 160, "cache full: {}", held.len());
    assert!(m.finished > 100, "requests finish: {}", m.finished);
    assert!(batches > 1_500, "most steps of a busy replica publish: {batches}");
}

#[test]
fn system_prompt_blocks_match_the_load_tests_text() {
    let config = FleetConfig::default();
    let p = SystemPrompts::new(&config);
    let sentence = "System prompt number 3 for the load test. ";
    let text: String = sentence.chars().cycle().take(4 * 1024).collect();
    assert_eq!(p.prompts[3].0, kvmesh_core::prompt::approximate_tokens(&text)[..1024]);
    assert_eq!(p.prompts[3].1.len(), 64);
    // Same content, same id on every replica; another prompt, other ids.
    assert_eq!(p.prompts[3].1, SystemPrompts::new(&config).prompts[3].1);
    assert_ne!(p.prompts[3].1[0], p.prompts[4].1[0]);
}

#[test]
fn a_full_page_reads_as_the_minimal_one() {
    let p = PageStats::default();
    for (a, v) in
        [(&p.running, 3), (&p.waiting, 2), (&p.cached, 1024), (&p.prompt_tokens, 50_000), (&p.generation_tokens, 7_000)]
    {
        a.store(v, Ordering::Relaxed);
    }
    let state = |rest| PageState { pages: Arc::new(Vec::new()), capacity: 4096, block_size: 16, rest };
    let (full, minimal) = (page_text(&p, &state(VLLM_PAGE_REST)), page_text(&p, &state("")));
    assert!(full.lines().count() > 500 && full.len() > 50_000, "{} lines, {} bytes", full.lines().count(), full.len());
    let read = |text: &str| kvmesh_events::parse_engine_page(text, 1.0).unwrap();
    let (f, m) = (read(&full), read(&minimal));
    assert_eq!(f, m);
    assert_eq!((f.metrics.running, f.metrics.waiting, f.metrics.kv_usage), (3, 2, 0.25));
    assert_eq!((f.served_tokens, f.kv_blocks, f.kv_block_size), (Some(57_000.0), Some(4096), Some(16)));
}
