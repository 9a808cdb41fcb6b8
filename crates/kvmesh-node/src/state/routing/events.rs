//! What KV events applied through the published index did, the prompts that place orphaned
//! stores, and adapters.

use super::Core;
use crate::state::{RecentPrompt, Replica, RECENT_PROMPTS, RECENT_PROMPT_TOKENS};
use kvmesh_core::ReplicaId;
use std::sync::Arc;

/// What a batch of one replica's KV events did ([`Core::events_applied`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AppliedBatch {
    /// Events the index accepted.
    pub accepted: u64,
    /// Events it refused.
    pub rejected: u64,
    /// Whether any was accepted or changed a block.
    pub heard: bool,
    /// Whether the replica's events can be routed on after them.
    pub usable: bool,
}

impl Core {
    /// Records what a batch of replica `name`'s KV events, applied through the published
    /// index (not under this lock), did at `now`: `accepted` and `rejected` events; `heard`
    /// when any was accepted or changed a block; `usable` as
    /// [`kvmesh_core::fleet::events_usable`] reads the index after them. `id` is the replica
    /// they were applied to: a replica removed and added again since is left alone. (The
    /// stream's own record, its counts and sequence, is the caller's:
    /// [`crate::state::Stream`].)
    pub fn events_applied(&mut self, name: &str, id: ReplicaId, batch: AppliedBatch, now: f64) {
        let Some(r) = self.replicas.get_mut(name).filter(|r| r.id == id) else { return };
        if batch.accepted + batch.rejected == 0 {
            return;
        }
        r.last_event_at = Some(now);
        r.unpublished_since = None;
        let _ = self.fleet.note_events(id, batch.heard, batch.usable, now);
    }

    /// A prompt `tokens` of namespace `selected` ended well on replica `name`: when its
    /// history is partial, it is kept among the replica's `recent_prompts` for stores still
    /// on their way, and the replica's id is returned when stores wait there now, for the
    /// caller to place those that continue it ([`kvmesh_core::index::IndexWriter::adopt_prompt`],
    /// outside this lock). `None` when the history is whole or nothing waits.
    pub fn keep_prompt(
        &mut self,
        name: &str,
        tokens: &Arc<[u32]>,
        selected: &crate::models::Selected,
    ) -> Option<ReplicaId> {
        let id = self.replicas.get(name)?.id;
        let (partial, waiting) = {
            let index = self.fleet.index();
            (index.history_is_partial(id), index.orphan_blocks(id))
        };
        if !partial {
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
        (waiting > 0).then_some(id)
    }

    /// The prompts kept for replica `name`'s waiting stores ([`Core::keep_prompt`]).
    pub fn recent_prompts(&self, name: &str) -> Vec<RecentPrompt> {
        self.replicas.get(name).map(|r| r.recent_prompts.iter().cloned().collect()).unwrap_or_default()
    }

    /// Replica `name` (id `id`)'s history turned whole (a restarted engine): the prompts kept
    /// for its waiting stores go.
    pub fn history_whole(&mut self, name: &str, id: ReplicaId) {
        if let Some(r) = self.replicas.get_mut(name).filter(|r| r.id == id) {
            r.recent_prompts.clear();
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
