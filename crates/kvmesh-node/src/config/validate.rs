//! Every check a configuration must pass before a node runs it (start, `--check`, reload,
//! and a replica registered through the API).

use super::{human, up_to_a_day, ConfigError, NodeConfig, NodeSection};
use kvmesh_core::{PolicyKind, Role};

impl NodeConfig {
    /// Checks values and combinations.
    ///
    /// # Errors
    /// The first of [`NodeConfig::refusals`]: [`ConfigError::Setting`] naming the key,
    /// [`ConfigError::Replica`] naming the replica, or [`ConfigError::Conflict`].
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.refusals().into_iter().next().map_or(Ok(()), Err)
    }

    /// Every refusal, at most one per part — the disaggregated models' engines, `[node]`,
    /// `[replication]`, `[autoscaler]`, `[admission]`, `[limits]`, `[epp]`, `[cluster]`, the
    /// replicas — in that order, so one run of `kvmesh node --check` shows them all. Empty
    /// when the configuration is valid.
    pub fn refusals(&self) -> Vec<ConfigError> {
        [
            self.check_engines(),
            self.check_node(),
            self.replication.validate(),
            self.autoscaler.validate(),
            self.admission.validate(),
            self.limits.validate(),
            self.epp.validate(),
            self.check_cluster(),
            self.check_replicas(),
        ]
        .into_iter()
        .filter_map(Result::err)
        .collect()
    }

    fn check_engines(&self) -> Result<(), ConfigError> {
        // One hand-over per model: a prefill replica's engine decides it, so a decode replica
        // of another engine would receive fields it does not read.
        let mut engines = std::collections::BTreeMap::<&str, (&str, &str)>::new();
        for r in self.replicas.iter().filter(|r| r.role != Role::Both) {
            let model = r.model.as_deref().unwrap_or(&self.node.model);
            let (first, name) = *engines.entry(model).or_insert((r.engine.as_str(), r.name.as_str()));
            if first != r.engine {
                return Err(ConfigError::Conflict(format!(
                    "model {model:?}: replica {:?} has engine {:?} but replica {name:?} has {first:?}; a disaggregated \
                     model's prefill and decode replicas must run one engine (it decides the hand-over)",
                    r.name, r.engine
                )));
            }
        }
        Ok(())
    }

    fn check_node(&self) -> Result<(), ConfigError> {
        let kind = self.node.policy.parse::<PolicyKind>().map_err(|e| match e {
            kvmesh_core::Error::UnknownPolicy { name, known } => {
                ConfigError::setting("node.policy", format!("names no policy ({name:?}); known policies: {known}"))
            }
            other => ConfigError::setting("node.policy", format!("is refused: {other}")),
        })?;
        kind.build_with(&self.node.params()).map_err(|e| match e {
            kvmesh_core::Error::InvalidConfig { reason, .. } => {
                ConfigError::setting("node.policy_params", format!("has a bad entry: {reason}"))
            }
            other => ConfigError::setting("node.policy_params", format!("are refused: {other}")),
        })?;
        if self.node.block_size == 0 {
            return Err(ConfigError::setting("node.block_size", "must be positive"));
        }
        self.node.replica_profile()?;
        if self.node.proxy_threads == 0 {
            return Err(ConfigError::setting("node.proxy_threads", "must be at least 1"));
        }
        let n = &self.node;
        for (key, d) in [
            ("node.scrape_interval", n.scrape_interval),
            ("node.request_timeout", n.request_timeout),
            ("node.booking_lease", n.booking_lease),
            ("node.replay_timeout", n.replay_timeout),
            (
                "autoscaler.interval",
                std::time::Duration::try_from_secs_f64(self.autoscaler.policy.interval_s)
                    .unwrap_or(std::time::Duration::MAX),
            ),
            (
                "replication.interval",
                std::time::Duration::try_from_secs_f64(self.replication.plan.interval_s)
                    .unwrap_or(std::time::Duration::MAX),
            ),
        ] {
            up_to_a_day(key, d, false)?;
        }
        // 0 is meaningful here: no backoff after a 429/503; an owed event is overdue at once.
        for (key, d) in [("node.overload_backoff", n.overload_backoff), ("node.events_silent", n.events_silent)] {
            up_to_a_day(key, d, true)?;
        }
        let hung = n.hung_after;
        if !(hung.is_zero() || hung >= 2 * n.scrape_interval) {
            let default = if hung == NodeSection::default().hung_after { " (its default)" } else { "" };
            return Err(ConfigError::Conflict(format!(
                "node.hung_after must be \"0s\" (off) or at least twice node.scrape_interval (\"{}\"), got \"{}\"{default}",
                human(2 * n.scrape_interval),
                human(hung)
            )));
        }
        let mut adapters = std::collections::HashSet::new();
        for a in &self.node.lora_adapters {
            if a.is_empty() || *a == self.node.model {
                let what = if a.is_empty() {
                    "an empty entry (remove it)".to_string()
                } else {
                    format!("the base model's name {a:?}")
                };
                return Err(ConfigError::setting("node.lora_adapters", format!("has {what}")));
            }
            if !adapters.insert(a) {
                return Err(ConfigError::setting("node.lora_adapters", format!("has {a:?} twice")));
            }
        }
        // A model named like an adapter could never be asked for: the adapter wins the name.
        if let Some(r) = self.replicas.iter().find(|r| r.model.as_ref().is_some_and(|m| adapters.contains(m))) {
            return Err(ConfigError::replica(
                &r.name,
                format!(
                    "model {:?} is also one of node.lora_adapters; a request naming it would get the adapter",
                    r.model.as_deref().unwrap_or_default()
                ),
            ));
        }
        if self.node.shutdown_grace > std::time::Duration::from_secs(3600) {
            return Err(ConfigError::setting(
                "node.shutdown_grace",
                format!("must be at most an hour (\"1h\"), got \"{}\"", human(self.node.shutdown_grace)),
            ));
        }
        Ok(())
    }

    fn check_cluster(&self) -> Result<(), ConfigError> {
        if let Some(c) = &self.cluster {
            if c.id == 0 {
                return Err(ConfigError::setting("cluster.id", "must be positive (or --id / KVMESH_NODE_ID)"));
            }
            let peers = c.peer_map()?;
            if !peers.is_empty() && !peers.contains_key(&c.id) {
                return Err(ConfigError::setting("cluster.peers", format!("must include this node (id {})", c.id)));
            }
            for (key, d) in [
                ("cluster.gossip_interval", c.gossip_interval),
                ("cluster.summary_interval", c.summary_interval),
                ("cluster.peer_timeout", c.peer_timeout),
                ("cluster.heartbeat", c.heartbeat),
                ("cluster.election_timeout_min", c.election_timeout_min),
                ("cluster.election_timeout_max", c.election_timeout_max),
            ] {
                up_to_a_day(key, d, false)?;
            }
            // In whole milliseconds, as openraft takes them.
            let ms = |d: std::time::Duration| d.as_millis();
            if ms(c.election_timeout_min) <= ms(c.heartbeat) || ms(c.election_timeout_max) <= ms(c.election_timeout_min)
            {
                return Err(ConfigError::Conflict(format!(
                    "cluster: need heartbeat < election_timeout_min < election_timeout_max, in whole milliseconds; got \
                     {} < {} < {} ms",
                    ms(c.heartbeat),
                    ms(c.election_timeout_min),
                    ms(c.election_timeout_max)
                )));
            }
            if c.peer_timeout <= 2 * c.summary_interval {
                return Err(ConfigError::Conflict(
                    "cluster: peer_timeout must exceed twice summary_interval (an idle peer is heard only through \
                     summaries)"
                        .into(),
                ));
            }
            if c.snapshot_every == 0 {
                return Err(ConfigError::setting("cluster.snapshot_every", "must be positive"));
            }
        }
        Ok(())
    }

    fn check_replicas(&self) -> Result<(), ConfigError> {
        let mut names = std::collections::HashSet::new();
        let mut engines: std::collections::HashMap<(&str, Option<u32>), &str> = std::collections::HashMap::new();
        // One block size per model; node.model's is node.block_size.
        let mut sizes: std::collections::HashMap<&str, (u32, &str)> = std::collections::HashMap::new();
        for r in &self.replicas {
            r.validate()?;
            let model = r.model.as_deref().filter(|m| !m.is_empty()).unwrap_or(&self.node.model);
            let bs = r.block_size.unwrap_or(self.node.block_size);
            if model == self.node.model && bs != self.node.block_size {
                return Err(ConfigError::replica(
                    &r.name,
                    format!(
                        "block_size {bs} differs from node.block_size {} (a replica of node.model has its block size; \
                         another model may have its own)",
                        self.node.block_size
                    ),
                ));
            }
            for a in r.lora_adapters.iter().flatten() {
                let taken = *a == self.node.model
                    || self.replicas.iter().any(|o| o.model.as_deref() == Some(a.as_str()))
                    || self.node.lora_adapters.iter().any(|n| n == a) && model != self.node.model;
                if taken {
                    return Err(ConfigError::replica(
                        &r.name,
                        format!("lora_adapters: {a:?} is a model's name (or node.model's adapter) here"),
                    ));
                }
            }
            match sizes.get(model) {
                Some(&(other, first)) if other != bs => {
                    return Err(ConfigError::replica(
                        &r.name,
                        format!(
                            "block_size {bs} differs from replica {first:?}'s {other}: the replicas of model {model:?} \
                             must share one block size"
                        ),
                    ))
                }
                _ => {
                    sizes.insert(model, (bs, &r.name));
                }
            }
            if !names.insert(&r.name) {
                return Err(ConfigError::replica(&r.name, super::error::REPEATED_NAME));
            }
            if let Some(first) = engines.insert(r.engine_key(), &r.name) {
                // Said of the second: its `http` is the line to change.
                return Err(ConfigError::replica(
                    &r.name,
                    format!(
                        "http routes to the same engine as replica {first:?} ({}{}): one engine under two names is \
                         booked and scraped twice",
                        r.http,
                        r.data_parallel_rank.map(|k| format!(", data-parallel rank {k}")).unwrap_or_default()
                    ),
                ));
            }
        }
        Ok(())
    }
}
