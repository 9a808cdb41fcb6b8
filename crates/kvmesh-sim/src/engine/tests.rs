//! Engine model tests: exact step times, chunking, prefix hits, events, eviction, preemption.

use super::*;
use kvmesh_core::Namespace;

fn profile(kv_tokens: u64, chunk: u32) -> EngineProfile {
    EngineProfile {
        name: "t".into(),
        prefill_s_per_token: 1e-5,
        decode_s_per_token: 1e-4,
        step_overhead_s: 1e-3,
        chunk_tokens: chunk,
        kv_tokens,
        max_batch: 8,
        cold_start_s: 0.0,
        kv_bytes_per_token: 131_072,
    }
}

fn engine(kv_tokens: u64, chunk: u32) -> Engine {
    let ns = Namespace { model: "engine".into(), ..Namespace::default() };
    Engine::new(profile(kv_tokens, chunk), BlockHasher::new(4, &ns).unwrap())
}

fn req(id: u64, tokens: std::ops::Range<u32>, out: u32) -> EngineRequest {
    EngineRequest {
        id,
        tokens: tokens.collect::<Vec<_>>().into(),
        output_tokens: out,
        lora: None,
        remote_prefill: false,
    }
}

fn step(e: &mut Engine) -> (f64, StepOutcome) {
    let mut rejected = Vec::new();
    let d = e.start_step(&mut rejected).expect("work to do");
    assert!(rejected.is_empty());
    (d, e.finish_step())
}

fn close(a: f64, b: f64) {
    assert!((a - b).abs() < 1e-12, "{a} != {b}");
}

#[test]
fn one_request_follows_the_step_model() {
    let mut e = engine(1000, 64);
    e.enqueue(req(1, 0..10, 3));
    let (d, out) = step(&mut e);
    close(d, 1e-3 + 10.0 * 1e-5);
    assert_eq!(out.first_tokens, vec![(1, 0)]);
    // Two full blocks of 4 tokens are cached and announced; the partial third is not.
    assert_eq!(out.events.len(), 1);
    let KvEvent::Stored(s) = &out.events[0] else { panic!("{:?}", out.events) };
    assert_eq!((s.block_hashes.len(), s.parent, s.token_ids.clone()), (2, None, (0..8).collect::<Vec<u32>>()));
    for _ in 0..2 {
        let (d, out) = step(&mut e);
        close(d, 1e-3 + 1e-4);
        assert!(out.first_tokens.is_empty());
    }
    assert!(!e.has_work());
    assert_eq!(e.metrics(), (0, 0, 0.0));
}

#[test]
fn a_remote_prefill_loads_its_prompt_whole_at_no_compute_cost_and_announces_its_blocks() {
    // A decode replica of a disaggregated pair: 40 prompt tokens received, a 16-token budget.
    let mut e = engine(1000, 16);
    e.enqueue(EngineRequest { remote_prefill: true, ..req(1, 0..40, 3) });
    e.enqueue(req(2, 100..120, 1));
    let (d, out) = step(&mut e);
    // Request 1 is loaded whole outside the budget; request 2 computes a 16-token chunk.
    close(d, 1e-3 + 16.0 * 1e-5);
    assert_eq!(out.first_tokens, vec![(1, 0)]);
    assert_eq!(out.prefill_tokens, 16, "loaded tokens are not computed");
    // Its 10 full blocks enter the cache and are announced, as a decode vLLM's are.
    let stored: usize =
        out.events.iter().map(|ev| if let KvEvent::Stored(s) = ev { s.block_hashes.len() } else { 0 }).sum();
    assert_eq!(stored, 10 + 4);
    let (d, _) = step(&mut e);
    // One decode token for request 1, request 2's last 4 prompt tokens.
    close(d, 1e-3 + 4.0 * 1e-5 + 1e-4);
}

#[test]
fn a_decode_side_lacks_only_the_blocks_its_cache_does_not_hold() {
    let mut e = engine(1000, 64);
    let cached: Vec<u32> = (0..40).collect();
    assert_eq!(e.lacking_blocks(&cached, None), 10);
    e.enqueue(req(1, 0..40, 1));
    step(&mut e);
    // 46 tokens: 11 full blocks and a partial one; the first 10 are cached.
    let longer: Vec<u32> = (0..46).collect();
    assert_eq!(e.lacking_blocks(&longer, None), 2);
    assert_eq!(e.lacking_blocks(&longer, Some("sql")), 12, "an adapter's blocks are another chain");
    let other: Vec<u32> = (100..146).collect();
    assert_eq!(e.lacking_blocks(&other, None), 12);
}

#[test]
fn long_prompts_prefill_in_chunks() {
    let mut e = engine(1000, 16);
    e.enqueue(req(1, 0..40, 1));
    let steps: Vec<f64> = (0..3).map(|_| step(&mut e).0).collect();
    close(steps[0], 1e-3 + 16.0 * 1e-5);
    close(steps[2], 1e-3 + 8.0 * 1e-5);
    assert_eq!(e.pending_prefill(), 0);
    assert!(!e.has_work(), "output of 1 token finishes at the first token");
}

#[test]
fn a_shared_prefix_is_not_recomputed_and_not_announced_again() {
    let mut e = engine(1000, 64);
    e.enqueue(req(1, 0..12, 1));
    step(&mut e);
    // Same first 8 tokens (2 blocks), then different ones.
    let mut toks: Vec<u32> = (0..8).collect();
    toks.extend(100..110);
    e.enqueue(EngineRequest { id: 2, tokens: toks.into(), output_tokens: 1, lora: None, remote_prefill: false });
    let (d, out) = step(&mut e);
    assert_eq!(out.first_tokens, vec![(2, 8)]);
    close(d, 1e-3 + 10.0 * 1e-5);
    let KvEvent::Stored(s) = &out.events[0] else { panic!() };
    assert_eq!(s.block_hashes.len(), 2, "blocks 2 and 3 are new; 0 and 1 were cached");
    assert!(s.parent.is_some());
    assert_eq!(s.token_ids, (100..108).collect::<Vec<u32>>());
}

#[test]
fn a_fully_cached_prompt_still_computes_its_last_token() {
    let mut e = engine(1000, 64);
    e.enqueue(req(1, 0..8, 1));
    step(&mut e);
    e.enqueue(req(2, 0..8, 1));
    let (d, out) = step(&mut e);
    assert_eq!(out.first_tokens, vec![(2, 4)], "only the first block may hit");
    close(d, 1e-3 + 4.0 * 1e-5);
}

#[test]
fn eviction_is_least_recently_used_and_announced() {
    // 12 tokens of KV = 3 blocks of 4.
    let mut e = engine(12, 64);
    e.enqueue(req(1, 0..5, 1)); // caches block A (0..4), partial block freed at finish
    step(&mut e);
    e.enqueue(req(2, 10..15, 1)); // caches block B
    step(&mut e);
    e.enqueue(req(3, 20..28, 1)); // needs 2 blocks: 1 free + evict A (least recently used)
    let (_, out) = step(&mut e);
    let KvEvent::Removed(r) = &out.events[0] else { panic!("{:?}", out.events) };
    assert_eq!(r.block_hashes.len(), 1);
    let a = BlockHasher::new(4, &Namespace { model: "engine".into(), ..Namespace::default() })
        .unwrap()
        .hash_blocks(&[0, 1, 2, 3]);
    assert_eq!(r.block_hashes[0].0, a[0].0);
    assert!(matches!(out.events[1], KvEvent::Stored(_)), "evictions come before stores");
}

#[test]
fn kv_shortage_preempts_the_newest_which_resumes_without_a_second_first_token() {
    // 24 tokens = 6 blocks of 4. Two requests of 7 prompt + 10 output tokens (5 blocks each
    // over their life) fit alone but not together once both decode far enough.
    let mut e = engine(24, 64);
    e.enqueue(req(1, 0..7, 10));
    e.enqueue(req(2, 50..57, 10));
    let (mut firsts, mut finished, mut preempted) = (Vec::new(), Vec::new(), false);
    for _ in 0..100 {
        if !e.has_work() {
            break;
        }
        let (_, out) = step(&mut e);
        firsts.extend(out.first_tokens.iter().map(|f| f.0));
        finished.extend(out.finished);
        preempted |= e.metrics() == (1, 1, e.metrics().2);
    }
    assert!(preempted, "request 2 was preempted");
    assert_eq!(firsts, vec![1, 2], "one first token each, none again on resume");
    assert_eq!(finished, vec![1, 2]);
    assert_eq!((e.pending_prefill(), e.kv().active()), (0, 0));
}

#[test]
fn a_request_preempted_mid_prefill_reports_the_hits_of_its_first_admission() {
    // 5 blocks of 4 tokens, 8-token chunks. R1 (3 prompt, 12 output) and R2 (16 prompt)
    // start together; R2 has computed 12 tokens (3 cached blocks) when its next chunk finds no
    // room beside R1's decode, so R2, the newest, is preempted. It comes back after R1 and
    // finds its own first block still cached. As vLLM's `num_cached_tokens`, its cached
    // tokens stay those of its first admission (none): a re-hit of its own blocks is not a
    // prefix-cache hit.
    let mut e = engine(20, 8);
    e.enqueue(req(1, 0..3, 12));
    e.enqueue(req(2, 100..116, 1));
    let (mut firsts, mut prefilled) = (Vec::new(), 0);
    while e.has_work() {
        let (_, out) = step(&mut e);
        firsts.extend(out.first_tokens);
        prefilled += out.prefill_tokens;
    }
    // R1's 3, R2's 12 before the preemption and 12 after it (its first block re-hit, not 16).
    assert_eq!(prefilled, 3 + 12 + 12);
    assert_eq!(firsts, vec![(1, 0), (2, 0)]);
}

#[test]
fn requests_that_can_never_fit_are_rejected() {
    let mut rejected = Vec::new();
    let mut e = engine(16, 64);
    e.enqueue(req(9, 0..10, 10)); // 20 tokens over its life: 5 blocks > 4
    assert_eq!(e.start_step(&mut rejected), None);
    assert_eq!(rejected, vec![9]);
    assert_eq!(e.pending_prefill(), 0);
}

#[test]
fn freed_chains_are_evicted_from_the_tail() {
    // 5 blocks. Request 1 caches a 3-block chain and ends; request 2 needs 4 blocks, so two
    // cached blocks must go: the chain's tail (blocks 2 and 1), keeping its root usable.
    let mut e = engine(20, 64);
    e.enqueue(req(1, 0..13, 1));
    step(&mut e);
    e.enqueue(req(2, 100..114, 1));
    let (_, out) = step(&mut e);
    let KvEvent::Removed(r) = &out.events[0] else { panic!("{:?}", out.events) };
    let ns = Namespace { model: "engine".into(), ..Namespace::default() };
    let chain = BlockHasher::new(4, &ns).unwrap().hash_blocks(&(0..12).collect::<Vec<u32>>());
    assert_eq!(r.block_hashes.iter().map(|h| h.0).collect::<Vec<_>>(), vec![chain[2].0, chain[1].0]);
    assert!(e.kv().contains(chain[0].0));
}

#[test]
fn a_request_that_does_not_fit_waits_without_touching_the_lru() {
    // 10 blocks of 4 tokens. R1 and R2 leave A0, A1 and B0, B1 cached and evictable, LRU
    // order A1, A0, B1, B0 (freed tail first). R3 runs a long decode; R4 shares A0, A1 but
    // needs 6 more blocks with only 6 available, 2 of them A0 and A1 themselves: it waits. As
    // in vLLM's `allocate_slots`, waiting must not touch the cache, so when R3's decode needs
    // room the least recently used block, A1, goes first (re-touching A0, A1 on every failed
    // admission would have sent B1 first).
    let mut e = engine(40, 64);
    e.enqueue(req(1, 0..10, 1));
    e.enqueue(req(2, 100..110, 1));
    let (_, out) = step(&mut e);
    assert_eq!(out.finished, vec![1, 2]);
    e.enqueue(req(3, 200..216, 12));
    e.enqueue(req(4, 0..30, 1));
    let mut removed = Vec::new();
    while !step_collecting_removals(&mut e, &mut removed, 3) {}
    let ns = Namespace { model: "engine".into(), ..Namespace::default() };
    let a = BlockHasher::new(4, &ns).unwrap().hash_blocks(&(0..8).collect::<Vec<u32>>());
    assert_eq!(removed.first(), Some(&a[1].0), "A1 is evicted first; all removals: {removed:?}");
}

/// Runs one step, appending removed engine hashes; true once request `id` has finished.
fn step_collecting_removals(e: &mut Engine, removed: &mut Vec<u64>, id: u64) -> bool {
    let (_, out) = step(e);
    for ev in &out.events {
        if let KvEvent::Removed(r) = ev {
            removed.extend(r.block_hashes.iter().map(|h| h.0));
        }
    }
    out.finished.contains(&id)
}

#[test]
fn an_aborted_request_frees_its_blocks_and_leaves_the_queue() {
    let mut e = engine(40, 4);
    e.enqueue(req(1, 0..8, 20));
    e.enqueue(req(2, 100..108, 1));
    // One step: request 1 gets the whole 4-token budget; request 2 waits.
    let _ = step(&mut e);
    assert_eq!((e.metrics().0, e.metrics().1, e.pending_prefill()), (1, 1, 12));
    assert!(e.abort(2), "a waiting request");
    assert_eq!((e.metrics().1, e.pending_prefill()), (0, 4));
    assert!(e.abort(1), "a running request");
    assert_eq!((e.metrics(), e.pending_prefill()), ((0, 0, 0.0), 0));
    assert!(!e.has_work());
    assert!(!e.abort(1), "already gone");
}

#[test]
fn blocks_filled_while_decoding_are_cached_and_announced() {
    // Block size 4: a 10-token prompt caches blocks 0–1 at prefill; its output fills block 2
    // (tokens 8–9 of the prompt, then two generated tokens' KV) at the third decode step.
    let mut e = engine(1000, 64).with_output_blocks();
    e.enqueue(req(1, 0..10, 6));
    let (_, out) = step(&mut e);
    let KvEvent::Stored(prompt) = &out.events[0] else { panic!("{:?}", out.events) };
    let last_prompt_block = *prompt.block_hashes.last().unwrap();
    // Decode steps write the KV of output tokens 1, 2, 3…: the second fills block 2.
    let (_, out) = step(&mut e);
    assert!(out.events.is_empty(), "{:?}", out.events);
    let (_, out) = step(&mut e);
    assert_eq!(out.events.len(), 1, "{:?}", out.events);
    let KvEvent::Stored(s) = &out.events[0] else { panic!("{:?}", out.events) };
    assert_eq!(
        (s.block_hashes.len(), s.parent, s.token_ids.clone()),
        (1, Some(last_prompt_block), vec![8, 9, output_token(1, 0), output_token(1, 1)])
    );
    assert_ne!(output_token(1, 0), output_token(2, 0), "another request samples another output");
    // The block is cached: freed with the request, then held evictable like a prompt block.
    while e.has_work() {
        step(&mut e);
    }
    assert_eq!(e.kv().used(), 3);
    // Without the option (the trace simulator's default) only prompt blocks are announced.
    let mut plain = engine(1000, 64);
    plain.enqueue(req(1, 0..10, 6));
    let mut stored = 0;
    while plain.has_work() {
        stored += step(&mut plain).1.events.len();
    }
    assert_eq!((stored, plain.kv().used()), (1, 2));
}
