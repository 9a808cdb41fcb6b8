//! The models this node routes: `node.model` (the default, served by every replica that
//! declares none) and each replica's own `model`. A request asks for one by the OpenAI API's
//! `model` (HTTP, the endpoint picker) or Route's `model`; it is routed only among the
//! replicas serving it, on blocks of that model's namespace ([`kvmesh_core::ModelKey`]).

use std::collections::BTreeMap;
use std::sync::Mutex;

/// The cache namespace a request selects: what its `model` field names, and its vLLM
/// `cache_salt` (hashed as the engine does: [`crate::state::Settings::hasher_for`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selected {
    /// A model other than `node.model`, when the request asks for one a replica declares;
    /// `None`: the default model.
    pub model: Option<String>,
    /// The LoRA adapter it names, if any: one of `node.lora_adapters` (of `node.model`), or
    /// one a replica declares or its engine lists (of that replica's model).
    pub adapter: Option<String>,
    /// Its `cache_salt` (a tenant's own prefix cache), if any.
    pub salt: Option<String>,
    /// Tokens per KV block of its model, when that model's replicas have another block size
    /// than `node.block_size`.
    pub block_size: Option<u32>,
}

/// The served models, by how many registered replicas serve each (one owner: the registry
/// calls [`ServedModels::added`] and [`ServedModels::removed`]).
#[derive(Debug)]
pub struct ServedModels {
    default: String,
    adapters: Vec<String>,
    replicas: Mutex<BTreeMap<String, usize>>,
    /// Adapters replicas declare or their engines list, each with its base model.
    learned: Mutex<BTreeMap<String, String>>,
    /// Models whose replicas have another block size than `node.block_size`, with it.
    block_sizes: Mutex<BTreeMap<String, u32>>,
}

impl ServedModels {
    /// The default model `node.model` (empty: any name no replica declares) and its LoRA
    /// adapters `node.lora_adapters`.
    pub fn new(default: &str, adapters: &[String]) -> Self {
        ServedModels {
            default: default.to_string(),
            adapters: adapters.to_vec(),
            replicas: Mutex::default(),
            learned: Mutex::default(),
            block_sizes: Mutex::default(),
        }
    }

    /// The model a replica declaring `model` serves (`node.model` when it declares none).
    pub fn of_replica<'a>(&'a self, model: Option<&'a str>) -> &'a str {
        model.filter(|m| !m.is_empty()).unwrap_or(&self.default)
    }

    /// A replica serving `model` (its declared one, or `None`) was registered.
    pub fn added(&self, model: Option<&str>) {
        let name = self.of_replica(model).to_string();
        *self.lock().entry(name).or_default() += 1;
    }

    /// A replica serving `model` was removed.
    pub fn removed(&self, model: Option<&str>) {
        let name = self.of_replica(model);
        let mut m = self.lock();
        if let Some(n) = m.get_mut(name) {
            *n -= 1;
            if *n == 0 {
                m.remove(name);
            }
        }
    }

    /// `model`'s replicas count `block_size`-token blocks (the routing core checked that they
    /// agree); requests for it are hashed so.
    pub fn set_block_size(&self, model: &str, block_size: u32) {
        self.block_sizes.lock().unwrap_or_else(|p| p.into_inner()).insert(model.to_string(), block_size);
    }

    /// A replica serving `model` (its declared one, or `None`) serves LoRA adapter `adapter`
    /// (declared, or listed by its engine): a request may name it. Returns whether it is new.
    /// An adapter already known under another base model keeps its first one.
    ///
    /// # Errors
    /// An adapter named like `node.model` or a served model: a request naming it asks for the
    /// model (the adapter is not learned).
    pub fn learn_adapter(&self, adapter: &str, model: Option<&str>) -> Result<bool, ModelError> {
        if adapter == self.default || self.lock().contains_key(adapter) {
            return Err(ModelError::AdapterNamedLikeModel(adapter.to_string()));
        }
        if self.adapters.iter().any(|a| a == adapter) {
            return Ok(false);
        }
        let base = self.of_replica(model).to_string();
        let mut learned = self.learned.lock().unwrap_or_else(|p| p.into_inner());
        if learned.contains_key(adapter) {
            return Ok(false);
        }
        learned.insert(adapter.to_string(), base);
        Ok(true)
    }

    /// What a request asking for `asked` (its `model` field; `None` or empty: unset) selects:
    /// one of `node.lora_adapters`, `node.model`, a model a replica declares, or — with
    /// `node.model` empty — the default model under any other name.
    ///
    /// # Errors
    /// The client's message when nothing here serves `asked` (HTTP 404, gRPC NOT_FOUND).
    pub fn select(&self, asked: Option<&str>) -> Result<Selected, ModelError> {
        let Some(asked) = asked.filter(|a| !a.is_empty()) else { return Ok(Selected::default()) };
        if self.adapters.iter().any(|a| a == asked) {
            return Ok(Selected { adapter: Some(asked.to_string()), ..Selected::default() });
        }
        if asked == self.default {
            return Ok(Selected::default());
        }
        let m = self.lock();
        if m.contains_key(asked) {
            let block_size = self.block_size_of(asked);
            return Ok(Selected { model: Some(asked.to_string()), block_size, ..Selected::default() });
        }
        // Models first: an adapter never takes a served model's name.
        if let Some(base) = self.learned.lock().unwrap_or_else(|p| p.into_inner()).get(asked) {
            let model = (*base != self.default).then(|| base.clone());
            let block_size = model.as_deref().and_then(|m| self.block_size_of(m));
            return Ok(Selected { model, adapter: Some(asked.to_string()), block_size, ..Selected::default() });
        }
        if self.default.is_empty() && (m.contains_key("") || m.is_empty()) {
            return Ok(Selected::default());
        }
        let served = m.keys().filter(|k| !k.is_empty()).cloned().collect();
        Err(ModelError::NotServed { asked: asked.to_string(), served })
    }

    /// Whether a gRPC Route's `lora_name` `adapter` is served: one of `node.lora_adapters` or
    /// of the adapters replicas declare or list, or any name when `node.lora_adapters` is
    /// empty.
    ///
    /// # Errors
    /// The caller's message (gRPC NOT_FOUND).
    pub fn adapter(&self, adapter: &str) -> Result<(), ModelError> {
        if self.adapters.is_empty()
            || self.adapters.iter().any(|a| a == adapter)
            || self.learned.lock().unwrap_or_else(|p| p.into_inner()).contains_key(adapter)
        {
            return Ok(());
        }
        Err(ModelError::AdapterNotServed { adapter: adapter.to_string(), configured: self.adapters.clone() })
    }

    /// `model`'s block size when its replicas' differs from the node's.
    fn block_size_of(&self, model: &str) -> Option<u32> {
        self.block_sizes.lock().unwrap_or_else(|p| p.into_inner()).get(model).copied()
    }

    /// The models served now, each with its replica count (`""`: `node.model` left empty).
    pub fn counts(&self) -> BTreeMap<String, usize> {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, usize>> {
        self.replicas.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A model or adapter name this node does not serve, or cannot take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// A request's `model` names nothing served here (HTTP 404, gRPC NOT_FOUND).
    #[error("model {asked:?} is not served here (this router serves {served:?})")]
    NotServed {
        /// The name asked for.
        asked: String,
        /// The models served, by name.
        served: Vec<String>,
    },
    /// A gRPC Route's `lora_name` is not one of `node.lora_adapters` nor learned (NOT_FOUND).
    #[error("LoRA adapter {adapter:?} is not served here (node.lora_adapters: {configured:?})")]
    AdapterNotServed {
        /// The adapter asked for.
        adapter: String,
        /// `node.lora_adapters`.
        configured: Vec<String>,
    },
    /// An adapter a replica declares or lists has a served model's name: not learned.
    #[error("LoRA adapter {0:?} has the name of a model served here: requests naming it go to the model")]
    AdapterNamedLikeModel(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sel(model: Option<&str>, adapter: Option<&str>) -> Selected {
        Selected { model: model.map(str::to_string), adapter: adapter.map(str::to_string), ..Selected::default() }
    }

    #[test]
    fn a_request_selects_the_default_a_declared_model_or_an_adapter() {
        let s = ServedModels::new("m1", &["sql-lora".to_string()]);
        s.added(None);
        s.added(Some("m2"));
        s.added(Some("m2"));
        assert_eq!(s.of_replica(None), "m1");
        assert_eq!(s.of_replica(Some("")), "m1");
        assert_eq!(s.select(None), Ok(sel(None, None)));
        assert_eq!(s.select(Some("")), Ok(sel(None, None)));
        assert_eq!(s.select(Some("m1")), Ok(sel(None, None)));
        assert_eq!(s.select(Some("m2")), Ok(sel(Some("m2"), None)));
        assert_eq!(s.select(Some("sql-lora")), Ok(sel(None, Some("sql-lora"))));
        let e = s.select(Some("m3")).unwrap_err();
        assert_eq!(e, ModelError::NotServed { asked: "m3".into(), served: vec!["m1".into(), "m2".into()] });
        assert_eq!(e.to_string(), "model \"m3\" is not served here (this router serves [\"m1\", \"m2\"])");
        // The last m2 replica gone, m2 is no longer served.
        s.removed(Some("m2"));
        assert_eq!(s.select(Some("m2")), Ok(sel(Some("m2"), None)));
        s.removed(Some("m2"));
        assert_eq!(s.counts(), BTreeMap::from([("m1".to_string(), 1)]));
        assert!(s.select(Some("m2")).is_err());
    }
    #[test]
    fn a_learned_adapter_never_takes_a_models_name() {
        let s = ServedModels::new("m1", &[]);
        s.added(None);
        s.added(Some("m2"));
        assert_eq!(s.learn_adapter("sql", Some("m2")), Ok(true));
        assert_eq!(s.learn_adapter("sql", None), Ok(false), "known already, under m2");
        assert!(s.learn_adapter("m1", None).is_err());
        assert_eq!(s.learn_adapter("m2", None).unwrap_err(), ModelError::AdapterNamedLikeModel("m2".into()));
        assert_eq!(s.select(Some("m2")), Ok(sel(Some("m2"), None)));
        assert_eq!(s.select(Some("sql")), Ok(sel(Some("m2"), Some("sql"))));
    }

    #[test]
    fn an_empty_default_takes_any_name_while_a_replica_declares_none() {
        let s = ServedModels::new("", &[]);
        // No replica yet: any name is the default (routing then says no replica is ready).
        assert_eq!(s.select(Some("anything")), Ok(sel(None, None)));
        s.added(Some("m2"));
        assert_eq!(s.select(Some("m2")), Ok(sel(Some("m2"), None)));
        assert_eq!(
            s.select(Some("anything")).unwrap_err().to_string(),
            "model \"anything\" is not served here (this router serves [\"m2\"])"
        );
        s.added(None);
        assert_eq!(s.select(Some("anything")), Ok(sel(None, None)));
    }
}
