//! KV events, the prompts that place orphaned stores, and adapters.

use super::adopt;
use super::Core;
use crate::state::{Replica, RECENT_PROMPTS, RECENT_PROMPT_TOKENS};
use kvmesh_core::index::{ApplyOutcome, KvEvent};
use std::sync::Arc;

impl Core {
    /// Applies one decoded event for `name`.
    pub fn apply(&mut self, name: &str, event: &KvEvent, now: f64) -> Option<ApplyOutcome> {
        let id = self.replicas.get(name)?.id;
        let mut outcome = self.fleet.apply_event(id, event, now).ok()?;
        if outcome.orphaned > 0 {
            // Perhaps the store of a request that already ended here: its prompt places it.
            let Core { replicas, fleet, .. } = self;
            for (tokens, selected) in &replicas.get(name)?.recent_prompts {
                if fleet.index().orphan_blocks(id) == 0 {
                    break;
                }
                if let Some(o) = adopt(fleet, id, tokens, selected) {
                    outcome.inferred += o.inferred;
                    outcome.adopted += o.adopted;
                }
            }
        }
        let r = self.replicas.get_mut(name)?;
        r.last_event_at = Some(now);
        r.unpublished_since = None;
        if outcome.rejection.is_some() {
            r.events_rejected += 1;
        } else {
            r.events_applied += 1;
        }
        Some(outcome)
    }

    /// A prompt `tokens` of namespace `selected` ended well on replica `name`: when its
    /// history is partial, the stores waiting there that continue it are placed now
    /// ([`kvmesh_core::Fleet::adopt_prompt`]), and it is kept among the replica's
    /// `recent_prompts` for stores still on their way. `None` when the history is whole.
    pub fn adopt_prompt(
        &mut self,
        name: &str,
        tokens: &Arc<[u32]>,
        selected: &crate::models::Selected,
    ) -> Option<kvmesh_core::index::ApplyOutcome> {
        let id = self.replicas.get(name)?.id;
        if !self.fleet.index().history_is_partial(id) {
            return None;
        }
        let r = self.replicas.get_mut(name)?;
        if tokens.len() <= RECENT_PROMPT_TOKENS {
            let mut kept: usize = r.recent_prompts.iter().map(|(t, _)| t.len()).sum();
            while r.recent_prompts.len() >= RECENT_PROMPTS || kept + tokens.len() > RECENT_PROMPT_TOKENS {
                let Some((gone, _)) = r.recent_prompts.pop_front() else { break };
                kept -= gone.len();
            }
            r.recent_prompts.push_back((tokens.clone(), selected.clone()));
        }
        if self.fleet.index().orphan_blocks(id) == 0 {
            return None;
        }
        adopt(&mut self.fleet, id, tokens, selected)
    }

    /// Says whether replica `name`'s event history is partial
    /// ([`kvmesh_core::Fleet::set_partial_history`]).
    pub fn set_partial_history(&mut self, name: &str, partial: bool) {
        if let Some(r) = self.replicas.get_mut(name) {
            let _ = self.fleet.set_partial_history(r.id, partial);
            if !partial {
                r.recent_prompts.clear();
            }
        }
    }

    /// The replicas (sorted ids, within `subset` when given) of model `model` that serve LoRA
    /// adapter `adapter` — declared in their `lora_adapters`, listed by their engine's
    /// `/v1/models`, or not known (taken to serve it: no answer yet, or an engine that lists
    /// no adapter at all, as SGLang's and a vLLM without `--enable-lora` do) — when that
    /// leaves any of the model's replicas out; `None` when all of them serve it.
    pub fn serving_adapter(
        &self,
        model: &str,
        adapter: &str,
        subset: Option<&[kvmesh_core::ReplicaId]>,
    ) -> Option<Vec<kvmesh_core::ReplicaId>> {
        let of_model = |r: &&Replica| self.fleet.replica(r.id).is_some_and(|s| s.spec.model == model);
        let serves = |r: &&Replica| {
            let listed = r.listed_adapters.as_ref().filter(|l| !l.is_empty());
            r.config.lora_adapters.as_ref().or(listed).is_none_or(|list| list.iter().any(|a| a == adapter))
        };
        if self.replicas.values().filter(of_model).all(|r| serves(&r)) {
            return None;
        }
        let mut ids: Vec<_> = self
            .replicas
            .values()
            .filter(|r| of_model(r) && serves(r) && subset.is_none_or(|s| s.binary_search(&r.id).is_ok()))
            .map(|r| r.id)
            .collect();
        ids.sort_unstable();
        Some(ids)
    }

    /// Why a request for LoRA adapter `adapter` of model `model` cannot be served: the
    /// model's replicas' adapters are all known and none serves it; `None` otherwise.
    pub fn adapter_unserved(&self, model: &str, adapter: &str) -> Option<String> {
        let serving = self.serving_adapter(model, adapter, None)?;
        serving.is_empty().then(|| {
            format!(
                "LoRA adapter {adapter:?} is served by no replica of {model:?} (a replica's adapters are its \
                 lora_adapters, or what its engine's /v1/models lists)"
            )
        })
    }
}
