//! Any text as an engine's Prometheus `/metrics` page (vLLM or SGLang names): parsing may fail
//! but must never panic; a page that parses gives a KV usage within [0, 1], and a served-token
//! count, when there is one, that is a number.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(page) = kvmesh_events::parse_engine_page(text, 1.0) {
        assert!((0.0..=1.0).contains(&page.metrics.kv_usage), "{:?}", page.metrics);
    }
    let _ = kvmesh_events::parse_engine_metrics(text, 1.0);
    if let Some(served) = kvmesh_events::parse_served_tokens(text) {
        assert!(!served.is_nan(), "served tokens NaN");
    }
});
