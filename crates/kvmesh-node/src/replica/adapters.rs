//! The LoRA adapters a replica serves, as its engine lists them: `GET /v1/models` at start and
//! every [`REFRESH`], its entries with a `parent` (vLLM's `OpenAIServingModels` lists each
//! adapter, loaded at start by `--lora-modules` or later by `/v1/load_lora_adapter`, with the
//! base model as its `parent`). Runs only for replicas whose config declares none. A base
//! model the engine lists that is not the one the replica is routed as is logged once: its
//! requests would name a model the engine does not serve. So is a real engine (`owned_by`
//! `vllm` or `sglang`) publishing KV events to a node without a `tokenizer`: its events carry
//! the model's token ids, which the node's approximate ids never match.

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
    /// Who serves it: `vllm` (vllm/entrypoints/openai/engine/protocol.py `ModelCard`),
    /// `sglang` (sglang/srt/entrypoints/openai/protocol.py `ModelCard`), `kvmesh-engine-sim`.
    #[serde(default)]
    owned_by: Option<String>,
}

/// What a `/v1/models` answer lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// Base models: the entries without a `parent`.
    pub models: Vec<String>,
    /// Adapters: the entries with one, sorted.
    pub adapters: Vec<String>,
    /// The entries' `owned_by`, sorted, once each.
    pub owners: Vec<String>,
}

/// The engines whose KV events carry their model's own token ids.
const REAL_ENGINES: [&str; 2] = ["vllm", "sglang"];

/// The start-up doubt for a replica whose engine lists `owners` and publishes KV events
/// (`follows`), on a node routing on approximate token ids (`approximate`: no `tokenizer`);
/// `None` when the ids can match.
pub fn approximate_ids_doubt(owners: &[String], approximate: bool, follows: bool) -> Option<String> {
    let engine = owners.iter().find(|o| REAL_ENGINES.contains(&o.as_str()))?;
    (approximate && follows).then(|| {
        format!(
            "the engine is {engine} (its /v1/models owned_by) and node.tokenizer is not set: its KV events carry \
             the model's token ids, which the node's approximate ids never match, so prefix overlap is never seen \
             (routed on load and the router's own record); set node.tokenizer to the model's tokenizer.json"
        )
    })
}

/// A `/v1/models` answer that is not an OpenAI model list.
#[derive(Debug, thiserror::Error)]
#[error("not an OpenAI model list: {0}")]
pub struct NotAModelList(#[from] serde_json::Error);

/// What a `/v1/models` answer `body` lists.
///
/// # Errors
/// A body that is not an OpenAI model list.
pub fn listed(body: &[u8]) -> Result<Listed, NotAModelList> {
    let list: ModelList = serde_json::from_slice(body)?;
    let (mut models, mut adapters) = (Vec::new(), Vec::new());
    let mut owners: Vec<String> = list.data.iter().filter_map(|m| m.owned_by.clone()).collect();
    owners.sort();
    owners.dedup();
    for m in list.data {
        if m.parent.is_some() {
            adapters.push(m.id)
        } else {
            models.push(m.id)
        }
    }
    adapters.sort();
    adapters.dedup();
    Ok(Listed { models, adapters, owners })
}

/// Asks `url` (the engine's `/v1/models`) for replica `name`'s adapters until aborted.
pub async fn run(shared: Arc<Shared>, name: String, url: String) {
    let mut tick = tokio::time::interval(REFRESH);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (mut model_doubt_said, mut ids_doubt_said) = (false, false);
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
            // Read by chunks, so a reply without a length is cut at the limit too.
            let (mut body, mut resp) = (Vec::new(), resp);
            while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
                if body.len() + chunk.len() > max {
                    return Err(format!("answer over {max} bytes"));
                }
                body.extend_from_slice(&chunk);
            }
            listed(&body).map_err(|e| e.to_string())
        }
        .await;
        let Listed { models, adapters, owners } = match got {
            Ok(l) => l,
            Err(e) => {
                tracing::debug!(replica = %name, %url, error = %e, "listing the engine's LoRA adapters failed");
                continue;
            }
        };
        let declared =
            shared.core().replicas.get(&name).map(|r| (r.config.model.clone(), r.config.kv_events.is_some()));
        let Some((declared, follows)) = declared else { continue };
        let approximate = matches!(shared.tokenizer, crate::tokenize::Tokenizer::Approximate);
        if let Some(doubt) = approximate_ids_doubt(&owners, approximate, follows).filter(|_| !ids_doubt_said) {
            ids_doubt_said = true;
            tracing::warn!(replica = %name, "{doubt}");
        }
        let routed_as = shared.models.of_replica(declared.as_deref()).to_string();
        if !model_doubt_said && !routed_as.is_empty() && !models.is_empty() && !models.contains(&routed_as) {
            model_doubt_said = true;
            tracing::warn!(
                replica = %name, engine_serves = ?models, routed_as = %routed_as,
                "the engine's /v1/models does not list the model this replica is routed as: requests naming it \
                 will be refused by the engine; set [[replicas]] model (or node.model) to the engine's \
                 --served-model-name"
            );
        }
        let mut core = shared.core();
        let Some(r) = core.replicas.get_mut(&name) else { continue };
        if r.listed_adapters.as_ref() == Some(&adapters) {
            continue;
        }
        r.listed_adapters = Some(adapters.clone());
        let model = r.config.model.clone();
        drop(core);
        for a in &adapters {
            if let Err(e) = shared.models.learn_adapter(a, model.as_deref()) {
                tracing::warn!(replica = %name, error = %e, "an adapter the engine lists is not routed as one");
            }
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
        let l = listed(body).unwrap();
        assert_eq!(l.adapters, ["chat", "sql"]);
        assert_eq!(l.models, ["meta-llama/Llama-3.1-8B"]);
        let l = listed(br#"{"object":"list","data":[{"id":"m"}]}"#).unwrap();
        assert_eq!((l.models, l.adapters), (vec!["m".to_string()], vec![]));
        assert!(listed(b"<html>").unwrap_err().to_string().starts_with("not an OpenAI model list"));
    }

    #[test]
    fn a_real_engine_publishing_events_to_a_node_without_a_tokenizer_is_doubted() {
        // vLLM's cards say `"owned_by": "vllm"`, adapters too.
        let body = br#"{"object":"list","data":[
            {"id":"m","object":"model","owned_by":"vllm","parent":null},
            {"id":"sql","object":"model","owned_by":"vllm","parent":"m"}]}"#;
        let owners = listed(body).unwrap().owners;
        assert_eq!(owners, ["vllm"]);
        assert_eq!(
            approximate_ids_doubt(&owners, true, true).unwrap(),
            "the engine is vllm (its /v1/models owned_by) and node.tokenizer is not set: its KV events carry the \
             model's token ids, which the node's approximate ids never match, so prefix overlap is never seen (routed \
             on load and the router's own record); set node.tokenizer to the model's tokenizer.json"
        );
        assert_eq!(approximate_ids_doubt(&owners, false, true), None, "a tokenizer: the ids match");
        assert_eq!(approximate_ids_doubt(&owners, true, false), None, "no events: nothing to match");
        // The engine-sim hashes kvmesh's approximate ids itself.
        let sim = listed(br#"{"object":"list","data":[{"id":"m","owned_by":"kvmesh-engine-sim"}]}"#).unwrap();
        assert_eq!(approximate_ids_doubt(&sim.owners, true, true), None);
        let sglang = listed(br#"{"object":"list","data":[{"id":"m","owned_by":"sglang"}]}"#).unwrap();
        assert!(approximate_ids_doubt(&sglang.owners, true, true).unwrap().starts_with("the engine is sglang"));
    }
}
