//! The rest of a vLLM server's `/metrics` page, served by the engine-sim and the fleet
//! emulator after the families they compute: a router that scrapes them parses a page of a real
//! server's size and shape.

/// The families of a vLLM server's `/metrics` page a router does not read, for one engine
/// (values fixed): the v1 engine's histograms with their bucket bounds
/// (vllm/v1/metrics/loggers.py), each counter's and histogram's `_created` series (Python
/// prometheus_client's default), the HTTP server's per-handler series
/// (prometheus-fastapi-instrumentator) and the Python process collectors.
pub(crate) const VLLM_PAGE_REST: &str = include_str!("fleet/vllm_page_rest.prom");
