//! The LoRA adapters a replica serves, as its engine lists them: `GET /v1/models` at start and
//! every [`REFRESH`], its entries with a `parent` (vLLM's `OpenAIServingModels` lists each
//! adapter, loaded at start by `--lora-modules` or later by `/v1/load_lora_adapter`, with the
//! base model as its `parent`). Runs only for replicas whose config declares none.

use crate::state::Shared;
use serde::Deserialize;
use std::sync::Arc;
use std::time::Duration;

/// How often the engine's model list is asked again.
pub const REFRESH: Duration = Duration::from_secs(10);

#[derive(Deserialize)]
struct ModelList {
    data: Vec<ModelCard>,
}

#[derive(Deserialize)]
struct ModelCard {
    id: String,
    #[serde(default)]
    parent: Option<String>,
}

/// The adapters listed in a `/v1/models` answer `body`: entries with a `parent`.
///
/// # Errors
/// A body that is not an OpenAI model list.
pub fn listed_adapters(body: &[u8]) -> Result<Vec<String>, String> {
    let list: ModelList = serde_json::from_slice(body).map_err(|e| format!("not an OpenAI model list: {e}"))?;
    let mut adapters: Vec<String> = list.data.into_iter().filter(|m| m.parent.is_some()).map(|m| m.id).collect();
    adapters.sort();
    adapters.dedup();
    Ok(adapters)
}

/// Asks `url` (the engine's `/v1/models`) for replica `name`'s adapters until aborted.
pub async fn run(shared: Arc<Shared>, name: String, url: String) {
    let mut tick = tokio::time::interval(REFRESH);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let got = async {
            let resp =
                shared.probe_http.get(&url).timeout(Duration::from_secs(5)).send().await.map_err(|e| e.to_string())?;
            if !resp.status().is_success() {
                return Err(format!("HTTP {}", resp.status()));
            }
            // A model list is small: a page past the metrics limit is not one.
            let max = shared.limits.metrics_max_page_bytes;
            if resp.content_length().is_some_and(|n| n > max as u64) {
                return Err(format!("answer over {max} bytes"));
            }
            let body = resp.bytes().await.map_err(|e| e.to_string())?;
            listed_adapters(&body)
        }
        .await;
        let adapters = match got {
            Ok(a) => a,
            Err(e) => {
                tracing::debug!(replica = %name, %url, error = %e, "listing the engine's LoRA adapters failed");
                continue;
            }
        };
        let mut core = shared.core();
        let Some(r) = core.replicas.get_mut(&name) else { continue };
        if r.listed_adapters.as_ref() == Some(&adapters) {
            continue;
        }
        r.listed_adapters = Some(adapters.clone());
        let model = r.config.model.clone();
        drop(core);
        for a in &adapters {
            shared.models.learn_adapter(a, model.as_deref());
        }
        tracing::info!(replica = %name, ?adapters, "the engine's LoRA adapters");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adapters_are_the_entries_with_a_parent() {
        // vLLM 0.33's /v1/models with two --lora-modules.
        let body = br#"{"object":"list","data":[
            {"id":"meta-llama/Llama-3.1-8B","object":"model","root":"meta-llama/Llama-3.1-8B","parent":null},
            {"id":"sql","object":"model","root":"/adapters/sql","parent":"meta-llama/Llama-3.1-8B"},
            {"id":"chat","object":"model","root":"/adapters/chat","parent":"meta-llama/Llama-3.1-8B"}]}"#;
        assert_eq!(listed_adapters(body), Ok(vec!["chat".to_string(), "sql".to_string()]));
        assert_eq!(listed_adapters(br#"{"object":"list","data":[{"id":"m"}]}"#), Ok(vec![]));
        assert!(listed_adapters(b"<html>").unwrap_err().starts_with("not an OpenAI model list"));
    }
}
